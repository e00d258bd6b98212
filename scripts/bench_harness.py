"""The benchmark's vocabulary: what a workload and a case are, the registry, the context a workload
process gets (its checkpoint, shape and device) and small helpers shared by every workload family.

A workload family is a module (`scripts/bench_*.py`) of functions `def my_workload(ctx: Context) ->
list[Case]` registered with `@workload(...)`; `scripts/bench.py` lists the families in WORKLOAD_MODULES.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parent.parent
PROBE, HF, TL = "probe", "transformers", "transformer-lens"
DTYPES = ("float32", "float16", "bfloat16")
SHAPES = {  # GPT2Config fields; vocabulary and context of the real GPT-2 unless tiny
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=64),
    "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
    "medium": dict(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024),
}
LAUNCH_SHAPE = (1, 16)  # (batch, seq) of the launch-bound workloads: Python and kernel launches, not arithmetic
SMALL_FALLBACK = dict(n_layer=4, n_embd=192, n_head=6, vocab_size=4096, n_positions=256)  # the bundled model's shape

# ---- what a workload is --------------------------------------------------------------------------
@dataclass
class Case:
    """One way of doing a workload's work. `run()` does it once and returns what it produced, which
    stays alive until the memory measurement is read (a cache's memory counts)."""

    label: str
    library: str
    run: Callable[[], Any]
    ratio_to: Optional[str] = None  # label of the case this one's time is divided by; None: the workload's floor
    timed: bool = True  # False: measured for memory only (a baseline another case's memory is compared to)
    note: str = ""


@dataclass
class Workload:
    key: str
    number: int
    title: str
    goal: str
    build: Callable[["Context"], list[Case]]
    floor: str  # label of the case ratios are taken to
    check: Optional[Callable[[dict[str, dict]], list[dict]]] = None  # rows by label -> goal verdicts
    model: str = "main"  # "main": the GPT-2-shape checkpoint; "small": the bundled model (or its stand-in)
    # "main": --batch x --seq; "small": --small-batch x --small-seq; "single": 1 x --seq; "launch": LAUNCH_SHAPE
    shape: str = "main"


WORKLOADS: dict[str, Workload] = {}


class SkipWorkload(Exception):
    """Raised by a workload's build when this machine or model cannot run it; the reason is reported."""


def workload(key: str, number: int, title: str, goal: str, floor: str, check=None, model: str = "main", shape: str = "main"):
    def register(build):
        WORKLOADS[key] = Workload(key, number, title, goal, build, floor, check, model, shape)
        return build

    return register


@dataclass
class Context:
    """What a workload process knows: its checkpoint, the token shape and where to run."""

    path: Path
    batch: int
    seq: int
    dtype: str
    device: str
    peer_missing: Optional[str] = None  # set when transformer-lens could not be loaded

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def vocab(self) -> int:
        return json.loads((self.path / "config.json").read_text())["vocab_size"]

    def tokens(self, seed: int = 0, batch: Optional[int] = None, seq: Optional[int] = None):
        import torch

        gen = torch.Generator().manual_seed(seed)
        shape = (batch or self.batch, seq or self.seq)
        return torch.randint(0, self.vocab, shape, generator=gen).to(self.device)

    # Each loader gives the library's model in eval mode, in the requested dtype, on the device.
    def probe_model(self):
        from probe import HookedDecoder

        return HookedDecoder.from_pretrained(self.path, device=self.device, dtype=self.torch_dtype).eval()

    def hf_model(self):
        from transformers import GPT2LMHeadModel

        # sdpa is transformers' default attention: the fastest floor it offers
        model = GPT2LMHeadModel.from_pretrained(self.path, attn_implementation="sdpa", **hf_dtype_kwarg(self.torch_dtype))
        return model.to(self.device).eval()

    def tl_bridge(self):
        """transformer-lens's TransformerBridge, or None where it cannot be imported (its cases are then
        dropped and the reason reported: a GPU machine without internet may lack it, and probe's rows
        still count). Call it while building the cases: the cases are filtered right after."""
        try:
            from transformer_lens.model_bridge import TransformerBridge
        except Exception as err:  # ImportError, or a dependency that breaks at import time
            self.peer_missing = f"transformer-lens unavailable ({type(err).__name__}: {str(err)[:200]})"
            return None
        return TransformerBridge

    def tl_model(self):
        """transformer-lens's model, or None where it cannot be imported (see `tl_bridge`)."""
        bridge = self.tl_bridge()
        if bridge is None:
            return None
        return bridge.boot_transformers(str(self.path), device=self.device, dtype=self.torch_dtype).eval()


def hf_dtype_kwarg(dtype) -> dict:
    from transformers import __version__

    major, minor = (int(x) for x in __version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def no_grad(fn: Callable[[], Any]) -> Callable[[], Any]:
    import torch

    def run():
        with torch.no_grad():
            return fn()

    return run


def is_resid(name: str) -> bool:
    return name.endswith(("hook_resid_pre", "hook_resid_mid", "hook_resid_post"))
# ---- goal checks ---------------------------------------------------------------------------------
def at_most(label: str, of: str, limit: float):
    """A goal check: rows[label]'s median time is at most `limit` times rows[of]'s."""

    def check(rows: dict[str, dict]) -> list[dict]:
        a, b = rows.get(label, {}).get("median_s"), rows.get(of, {}).get("median_s")
        ratio = a / b if a is not None and b else None
        return [dict(measure=f"time: {label} / {of}", ratio=ratio, limit=limit, met=None if ratio is None else ratio <= limit)]

    return check


def all_of(*checks):
    return lambda rows: [verdict for check in checks for verdict in check(rows)]




def mib(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"
