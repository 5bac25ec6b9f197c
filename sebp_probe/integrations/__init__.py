"""Entry points for other training loops: :mod:`.hf` (Hugging Face ``Trainer`` and TRL's ``SFTTrainer``)."""
