"""One channel for notes (sebp_probe.notes): each line once, to the innermost collection, else to the logger;
finetune turns every note (the data's, a family's fallback, a resumed run's) into one event and one summary
line."""
from __future__ import annotations

import logging

import pytest

from sebp_probe.train import finetune as ft
from sebp_probe.data.assets import LoadedModel
from sebp_probe.config import DataConfig, FinetuneConfig
from sebp_probe.notes import collect_notes, note
from tests.convergence.finetune_helpers import isolated_accelerate, synthetic_data  # noqa: F401
from tests.tiny_models import tiny_model


def test_a_note_goes_to_the_innermost_collection_once_else_to_the_logger(caplog):
    heard = []
    with caplog.at_level(logging.WARNING, logger="sebp_probe"):
        with collect_notes(heard.append) as outer:
            note("first  line\n wrapped")
            with collect_notes() as inner:
                note("inner")
            note("first line wrapped")  # said before: not again
            note("second")
        note("outside")
    assert outer == heard == ["first line wrapped", "second"] and inner == ["inner"]
    assert [r.getMessage() for r in caplog.records if r.name == "sebp_probe"] == ["outside"]


@pytest.mark.slow
def test_finetune_says_every_note_once_as_an_event_and_in_the_summary(tmp_path, caplog):
    data = synthetic_data("classification", n=24, n_eval=8)
    data.identity["train"] = {"notes": ["labels mapped"]}
    data.identity["eval"] = {"notes": ["labels mapped"]}  # the same line from both splits: said once
    events = []
    model = tiny_model("bert")
    model.config.model_type = "unknown"  # no family entry: packed and the labelled head fall back, said

    def run():
        cfg = FinetuneConfig(model="tiny", data=DataConfig(max_length=24, batch_size=8, padding="packed"),
                             output_dir=str(tmp_path / "run"), max_steps=2, method="dense", seed=0)
        load = lambda: LoadedModel(model, None, "classification", "tiny", "config")  # noqa: E731
        return ft.finetune(cfg, load_fn=load, data=data, on_event=lambda k, p: events.append((k, p)),
                           overwrite=True)

    with caplog.at_level(logging.WARNING, logger="sebp_probe"):
        summary = run()
    said = [p["text"] for k, p in events if k == "note"]
    assert said == summary["notes"] and said[0] == "labels mapped" and len(said) == 3
    assert said[1].startswith("--padding packed runs as --padding bucket: ")
    assert said[2].startswith("--head labelled runs as --head full")
    assert not caplog.records  # nothing went around the channel
