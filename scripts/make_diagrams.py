"""Draw the pictures in docs/img/ (matplotlib only).

    python scripts/make_diagrams.py            # writes docs/img/architecture.png

The architecture picture is the component map of docs/ARCHITECTURE.md: one box per module or
folder, placed in the order data flows from a GGUF file to text, coloured by where it runs.
Boxes and arrows are data below, so a new component is one more line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "img"

COLOURS = {"cpu": "#dbe9f6", "gpu": "#fde2c8", "data": "#e6e6e6", "cuda": "#d9f0d3"}
LEGEND = {"cpu": "Python / numpy on the CPU", "gpu": "WGSL on the WebGPU device",
          "data": "files on disk", "cuda": "CUDA megakernel (NVIDIA only)"}

# name -> (x, y, width, height, kind, text); the main path runs top to bottom in the second column
BOXES = {
    "gguf": (4.0, 13.0, 4.0, 0.9, "data", "model.gguf\n(metadata, tokenizer, quantized tensors)"),
    "families": (0.2, 11.3, 3.2, 0.9, "data", "family/*.toml\n(keys, tensor names, switches)"),
    "gguf_file": (4.0, 11.3, 4.0, 0.9, "cpu", "gguf_file.py\nbounded parser, memory-mapped tensors"),
    "tokenizer": (8.7, 11.3, 3.4, 0.9, "cpu", "tokenizer.py, chat_template.py\ntext <-> ids, prompts"),
    "family": (4.0, 9.8, 4.0, 0.9, "cpu", "family.py\nModelConfig (sizes + switches)"),
    "pack": (4.0, 8.3, 4.0, 0.9, "cpu", "gpu/pack.py, quant_layout.py, chunks.py\nre-laid blocks, one buffer per layer"),
    "shaders": (0.2, 6.8, 3.2, 0.9, "gpu", "shaders/*.wgsl\ngemv, gemm, attention, rope, ..."),
    "runtime": (4.0, 6.8, 4.0, 0.9, "gpu", "gpu/runtime.py, runtime_ops.py, kernels.py\none command buffer per token"),
    "reference": (0.2, 5.3, 3.2, 0.9, "cpu", "reference.py\nnumpy oracle (same Backend)"),
    "engine": (4.0, 5.3, 4.0, 0.9, "cpu", "engine.py\nsampling.py, streaming.py"),
    "server": (2.0, 3.8, 3.6, 0.9, "cpu", "server/ (FastAPI)\nOpenAI API, one queue"),
    "cli": (6.4, 3.8, 3.6, 0.9, "cpu", "cli.py + commands/\nrun, chat, bench, perplexity, ..."),
    "planner": (12.8, 11.3, 3.4, 0.9, "cpu", "megakernel/planner.py, package.py\ntasks in waves, BF16 weights"),
    "vm": (12.8, 8.3, 3.4, 0.9, "cpu", "megakernel/validator.py, vm.py\nplan checks, numpy VM"),
    "cuda": (12.8, 6.8, 3.4, 0.9, "cuda", "megakernel/cuda_runtime.py\nworker.cu (one launch)"),
}
ARROWS = [  # (from, to, label, sides): sides ("bottom", "right") overrides the facing sides
    ("gguf", "gguf_file", "", None),
    ("families", "family", "matched by\ngeneral.architecture", ("bottom", "left")),
    ("gguf_file", "family", "", None),
    ("gguf_file", "tokenizer", "", None),
    ("family", "pack", "", None),
    ("pack", "runtime", "weights, K/V cache,\nscratch (made once)", None),
    ("shaders", "runtime", "pipelines", None),
    ("runtime", "engine", "logits", None),
    ("reference", "engine", "", None),
    ("tokenizer", "engine", "ids", ("bottom", "right")),
    ("engine", "server", "", None),
    ("engine", "cli", "", None),
    ("gguf", "planner", "", ("right", "top")),
    ("planner", "vm", "the plan replayed", None),
    ("vm", "cuda", "bit-identical", None),
    ("cuda", "engine", "--backend cuda", ("left", "right")),
]
SIDES = {"top": (0.5, 1.0), "bottom": (0.5, 0.0), "left": (0.0, 0.5), "right": (1.0, 0.5)}


def _side(box: tuple, side: str) -> tuple[float, float]:
    x, y, w, h = box[:4]
    fx, fy = SIDES[side]
    return x + fx * w, y + fy * h


def _facing(box: tuple, toward: tuple) -> str:
    """The side of `box` that faces the centre of `toward`."""
    x, y, w, h = box[:4]
    dx = toward[0] + toward[2] / 2 - (x + w / 2)
    dy = toward[1] + toward[3] / 2 - (y + h / 2)
    if abs(dy) >= abs(dx) * 0.35:
        return "bottom" if dy < 0 else "top"
    return "left" if dx < 0 else "right"


def draw_architecture(path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(16, 11))
    ax.set_xlim(0, 16.4)
    ax.set_ylim(3.2, 14.3)
    ax.axis("off")
    for x, y, w, h, kind, text in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", facecolor=COLOURS[kind],
                                    edgecolor="#555555", linewidth=1))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)
    for start, end, label, sides in ARROWS:
        a, b = BOXES[start], BOXES[end]
        from_side, to_side = sides or (_facing(a, b), _facing(b, a))
        p, q = _side(a, from_side), _side(b, to_side)
        ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=12, color="#333333",
                                     linewidth=1, shrinkA=2, shrinkB=2))
        if label and p[1] == q[1]:  # horizontal: the label above the arrow
            ax.text((p[0] + q[0]) / 2, p[1] + 0.06, label, fontsize=7.5, color="#333333", ha="center", va="bottom")
        elif label:
            ax.text((p[0] + q[0]) / 2 + 0.08, (p[1] + q[1]) / 2, label, fontsize=7.5, color="#333333",
                    ha="left", va="center")
    handles = [FancyBboxPatch((0, 0), 1, 1, facecolor=COLOURS[k], edgecolor="#555555") for k in LEGEND]
    ax.legend(handles, LEGEND.values(), loc="lower right", fontsize=8, frameon=False)
    ax.set_title("airframe: from a GGUF file to text", fontsize=12)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT, help="folder for the PNG files (default docs/img)")
    args = p.parse_args(argv)
    print(f"wrote {draw_architecture(args.out / 'architecture.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
