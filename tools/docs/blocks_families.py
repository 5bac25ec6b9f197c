"""The generated block of docs/finetune.md made from the model-family registry (sebp_probe.families), not from
results/: which families the default command knows and what each gets."""
from __future__ import annotations

import sys

from docgen import ROOT, Page, block, table


def _registry():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from sebp_probe.families import FAMILIES  # imports torch: only this block needs it

    return FAMILIES


@block("families", from_code=True)
def families(page: Page) -> str:
    rows = []
    for model_type, f in _registry().items():
        head = "-"
        if f.layer is not None:
            head = "causal LM" if f.block == "decoder" else "classifier ([CLS] rows)" + (", MLM" if f.mlm else "")
            if f.logit_softcap:
                head += ", logit softcap"
            if f.logit_divisor:
                head += f", `{f.logit_divisor}`"
        packed = "-" if not f.packed else "classifier" if f.first_token else "causal LM"
        norms = ("RMSNorm" if f.rms_norms else "-") if f.block == "decoder" else "LayerNorm"
        acts = "SwiGLU" if f.gated_mlps else "GELU" if f.gelu_mlps else "-"
        targets = ", ".join(f"`{t}`" for t in f.targets)
        if f.experts:  # the fused experts come with the projections; the router stays dense
            targets += "; the experts' fused `gate_up_proj`, `down_proj` (router dense)"
        rows.append([f.name, f"`{model_type}`", targets, head, packed, norms, acts])
    rows.append(["any other", "", "every `nn.Linear` and `Conv1D` but the output head (one note, naming what "
                 "stays dense)", "- (one note)",
                 "- (bucket, one note)", "LayerNorm", "-"])
    return table(["family", "model type", "SEBP targets (default)", "`--head labelled`", "`--padding packed`",
                  "`--sebp-norms`", "`--sebp-acts`"], rows, "lllllll")
