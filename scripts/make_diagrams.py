"""Draw the pictures in docs/img/ (matplotlib only).

    python scripts/make_diagrams.py            # writes docs/img/architecture.png

The architecture picture is the component map of docs/ARCHITECTURE.md: one box per module or
folder, placed in the order data flows from a GGUF file to text (file, family, model, the backend
seam and the three backends, engine, server and CLI), coloured by where it runs, with a frame
around each backend's folder. Frames, boxes and arrows are data below, so a new component is one
more line.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "img"

COLOURS = {"cpu": "#dbe9f6", "gpu": "#fde2c8", "data": "#e6e6e6", "cuda": "#d9f0d3"}
LEGEND = {"cpu": "Python / numpy on the CPU", "gpu": "WGSL on the WebGPU device",
          "data": "files on disk", "cuda": "CUDA megakernel (NVIDIA only)"}

# name -> (x, y, width, height, title): a backend's folder, drawn behind its boxes
FRAMES = {
    "gpu": (0.2, 4.8, 10.25, 3.6, "airframe/gpu/ (--backend webgpu)"),
    "megakernel": (13.3, 4.8, 4.2, 3.6, "airframe/megakernel/ (--backend cuda)"),
}
# name -> (x, y, width, height, kind, text); the main path runs top to bottom in the middle
BOXES = {
    "gguf": (5.0, 13.3, 4.4, 0.9, "data", "model.gguf\n(metadata, tokenizer, quantized tensors)"),
    "families": (0.2, 13.3, 3.6, 0.9, "data", "family/*.toml\n(keys, tensor names, switches)"),
    "gguf_file": (5.0, 11.9, 4.4, 0.9, "cpu", "gguf_file.py\nbounded parser, memory-mapped tensors"),
    "family": (0.2, 11.9, 3.6, 0.9, "cpu", "family.py\nModelConfig (sizes + switches)"),
    "model": (5.0, 10.5, 4.4, 0.9, "cpu", "model.py: open_model\nModel = path + GGUFFile + ModelConfig"),
    "tokenizer": (0.2, 10.5, 3.6, 0.9, "cpu", "tokenizer.py, chat_template.py\ntext <-> ids, prompts"),
    "options": (10.8, 10.5, 4.2, 0.9, "cpu", "options.py: RunOptions\nn_ctx, matmul, reduce, debug"),
    "seam": (0.2, 9.0, 17.3, 0.9, "cpu", "backend.py: the seam.  Backend.load(model, options), reset, forward, "
             "greedy_stream (where greedy_on_device);\ncheck_tokens, the one validation;  "
             "open_backend(name, model, options)"),
    # airframe/gpu/, in the order a load goes through it: a snake, left to right then back
    "device": (0.45, 6.75, 2.15, 0.9, "cpu", "device.py\nadapter, limits"),
    "pack": (3.0, 6.75, 2.15, 0.9, "cpu", "pack.py (+ quants.py)\nweights in buffers"),
    "pipelines": (5.55, 6.75, 2.15, 0.9, "cpu", "pipelines.py\n+ shaders.py: programs"),
    "shaders": (8.1, 6.75, 2.15, 0.9, "gpu", "shaders/*.wgsl\ngemv, gemm, attention"),
    "layer": (5.55, 5.05, 2.15, 0.9, "cpu", "layer.py\na layer's dispatches"),
    "gpu_backend": (3.0, 5.05, 2.15, 0.9, "cpu", "backend.py\nWebGPUBackend"),
    "greedy": (0.45, 5.05, 2.15, 0.9, "cpu", "greedy.py\nargmax chain"),
    "reference": (10.75, 5.05, 2.3, 2.6, "cpu", "reference.py\n(--backend reference)\n\nnumpy oracle:\nfloat32,\n"
                  "one function per op"),
    "plan": (13.55, 6.75, 3.7, 0.9, "cpu", "plan/ (pure CPU): opcodes, target,\nplanner, package, validator, vm"),
    "cuda": (13.55, 5.05, 3.7, 0.9, "cuda", "cuda/: build, probe, runtime,\nbackend; worker.cu"),
    "engine": (6.0, 2.6, 4.6, 0.9, "cpu", "engine.py: one generation loop\nsampling.py, streaming.py"),
    "server": (2.8, 1.0, 3.8, 0.9, "cpu", "server/ (FastAPI)\nOpenAI API, one queue"),
    "cli": (10.0, 1.0, 3.8, 0.9, "cpu", "cli.py + commands/\nrun, chat, serve, bench, ..."),
}


class Arrow(NamedTuple):
    start: str        # a box or frame
    end: str
    label: str = ""
    sides: tuple | None = None  # (from side, to side): a name of SIDES or (fx, fy) of the box
    via: tuple = ()   # corners the arrow passes through, in picture coordinates


ARROWS = [
    Arrow("gguf", "gguf_file"),
    Arrow("families", "family", "matched by general.architecture"),
    Arrow("gguf_file", "family", "metadata"),
    Arrow("gguf_file", "model"),
    Arrow("family", "model", "ModelConfig", ("bottom", (0.0, 0.75))),
    Arrow("model", "tokenizer", "", ((0.0, 0.25), (1.0, 0.25))),
    Arrow("model", "seam", "Model (the GGUF parsed once)", ("bottom", (0.41, 1.0))),
    Arrow("options", "seam", "RunOptions (built by the command)", ("bottom", (0.75, 1.0))),
    Arrow("seam", "gpu", "load", ((0.29, 0.0), "top")),
    Arrow("seam", "reference", "load", ((0.69, 0.0), "top")),
    Arrow("seam", "megakernel", "load", ((0.89, 0.0), "top")),
    Arrow("device", "pack"),
    Arrow("pack", "pipelines"),
    Arrow("shaders", "pipelines"),
    Arrow("pipelines", "layer", "bind groups"),
    Arrow("layer", "gpu_backend"),
    Arrow("gpu_backend", "greedy"),
    Arrow("plan", "cuda", "a validated package"),
    Arrow("gpu_backend", "engine", "logits, greedy ids", ("bottom", (0.0, 0.75))),
    Arrow("reference", "engine", "logits", ("bottom", (0.85, 1.0))),
    Arrow("cuda", "engine", "logits, greedy ids", ("bottom", (1.0, 0.5))),
    Arrow("tokenizer", "engine", "ids, text", ("left", (0.0, 0.3)), ((-0.3, 10.95), (-0.3, 2.87))),
    Arrow("engine", "server"),
    Arrow("engine", "cli"),
]
SIDES = {"top": (0.5, 1.0), "bottom": (0.5, 0.0), "left": (0.0, 0.5), "right": (1.0, 0.5)}


def _shape(name: str) -> tuple:
    return BOXES[name] if name in BOXES else FRAMES[name]


def _point(shape: tuple, side) -> tuple[float, float]:
    x, y, w, h = shape[:4]
    fx, fy = SIDES[side] if isinstance(side, str) else side
    return x + fx * w, y + fy * h


def _facing(box: tuple, toward: tuple) -> str:
    """The side of `box` that faces the centre of `toward`."""
    x, y, w, h = box[:4]
    dx = toward[0] + toward[2] / 2 - (x + w / 2)
    dy = toward[1] + toward[3] / 2 - (y + h / 2)
    if abs(dy) >= abs(dx) * 0.35:
        return "bottom" if dy < 0 else "top"
    return "left" if dx < 0 else "right"


def _label(ax, p: tuple, q: tuple, label: str) -> None:
    style = dict(fontsize=7.5, color="#333333")
    if abs(p[1] - q[1]) < 1e-6:  # horizontal: the label above the arrow
        ax.text((p[0] + q[0]) / 2, p[1] + 0.06, label, ha="center", va="bottom", **style)
    else:
        ax.text((p[0] + q[0]) / 2 + 0.08, (p[1] + q[1]) / 2, label, ha="left", va="center", **style)


def draw_architecture(path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(16, 13))
    ax.set_xlim(-0.6, 17.7)
    ax.set_ylim(0.7, 14.4)
    ax.axis("off")
    for x, y, w, h, title in FRAMES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", facecolor="#f6f6f6",
                                    edgecolor="#999999", linewidth=1, linestyle="--"))
        ax.text(x + 0.15, y + h - 0.12, title, ha="left", va="top", fontsize=8.5, fontweight="bold")
    for x, y, w, h, kind, text in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.05", facecolor=COLOURS[kind],
                                    edgecolor="#555555", linewidth=1))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)
    for arrow in ARROWS:
        a, b = _shape(arrow.start), _shape(arrow.end)
        from_side, to_side = arrow.sides or (_facing(a, b), _facing(b, a))
        points = [_point(a, from_side), *arrow.via, _point(b, to_side)]
        for p, q in zip(points[:-2], points[1:-1]):  # the corners: plain lines
            ax.plot([p[0], q[0]], [p[1], q[1]], color="#333333", linewidth=1)
        p, q = points[-2], points[-1]
        ax.add_patch(FancyArrowPatch(p, q, arrowstyle="-|>", mutation_scale=12, color="#333333",
                                     linewidth=1, shrinkA=0 if arrow.via else 2, shrinkB=2))
        if arrow.label:  # beside the first segment, or the last one of a bent arrow
            first, second = (p, q) if arrow.via else (points[0], points[1])
            _label(ax, first, second, arrow.label)
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
