"""Training: which layers run SEBP (calibration), --padding auto (strategy), CUDA graphs and torch.compile
(graphs, compiling), one run (loop), its output directory and metrics (rundir, metrics, lora_merge) and the
fine-tuning entry point (finetune)."""
