"""probe cache: run a prompt (or a file of prompts) and save chosen activations to safetensors.

examples:
  probe cache --prompt "ROMEO. But soft" --names "blocks.*.hook_resid_post" --out runs/cache
  probe cache --prompts-file prompts.txt --names "*hook_pattern" --store-dtype bfloat16
  probe cache --show runs/cache/activations.safetensors
"""
from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path
from typing import Optional, Sequence

from probe.cli.common import CommandError, HelpFormatter, Output, add_common_arguments, default_out, load_model, log, read_prompts_file, run_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="probe cache", description=__doc__, formatter_class=HelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="the prompt to run")
    source.add_argument("--prompts-file", help="a UTF-8 text file, one prompt per line")
    source.add_argument("--show", metavar="FILE", help="summarise a saved cache instead of running")
    parser.add_argument("--names", action="append", default=None,
                        help="hook-name pattern (shell-style: blocks.*.hook_resid_post); repeat for several; default: all")
    parser.add_argument("--store-dtype", default=None, choices=["float32", "float16", "bfloat16"], help="precision to store in")
    add_common_arguments(parser)
    return parser


def select_names(model, patterns: Optional[list[str]]) -> list[str]:
    if not patterns:
        return model.select_hook_names(None)
    chosen: list[str] = []
    for pattern in patterns:
        matches = [n for n in model.hook_names if fnmatch.fnmatchcase(n, pattern)]
        if not matches:
            import difflib

            close = difflib.get_close_matches(pattern, model.hook_names, n=3, cutoff=0.4)
            hint = f" (closest names: {', '.join(close)})" if close else ""
            raise CommandError(f"--names {pattern!r} matches no hook point{hint}; see `probe anatomy` for the names")
        chosen += [n for n in matches if n not in chosen]
    return chosen


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file:
        return read_prompts_file(args.prompts_file, "--prompts-file")
    if args.prompt is None:
        raise CommandError("give --prompt TEXT, --prompts-file FILE, or --show FILE")
    return [args.prompt]


def show(path: Path) -> int:
    import json

    from safetensors import safe_open

    if not path.is_file():
        raise CommandError(f"--show {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            rows = [(n, tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in names]
            meta = f.metadata() or {}
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise CommandError(f"--show {path} is not a readable safetensors file: {err}") from err
    if "prompts" in meta:
        print(f"prompts: {json.loads(meta['prompts'])}")
    width = max((len(n) for n in names), default=4)
    for name, shape, dtype in rows:
        print(f"{name:<{width}}  {str(list(shape)):<22} {dtype}")
    print(f"{len(rows)} tensors")
    return 0


def run(args: argparse.Namespace) -> int:
    import json

    import torch
    from safetensors.torch import save

    if args.show:
        return show(Path(args.show))
    prompts = read_prompts(args)
    out = Output(default_out(args, "cache"), args.force)
    model = load_model(args)
    names = select_names(model, args.names)
    store_dtype = getattr(torch, args.store_dtype) if args.store_dtype else None
    with torch.no_grad():
        _, cache = model.run_with_cache(prompts, names=names, dtype=store_dtype, device="cpu")
        _, mask = model.to_tokens(prompts, return_attention_mask=True)
    tensors = {name: t.contiguous().clone() for name, t in cache.items()}  # resid_post(l) and resid_pre(l+1) share memory
    tensors["attention_mask"] = mask.cpu()
    metadata = {"model": str(args.model), "revision": str(args.revision or ""), "prompts": json.dumps(prompts)}
    out.write_bytes("activations.safetensors", save(tensors, metadata=metadata))
    import pandas as pd

    index = pd.DataFrame([{"name": n, "shape": "x".join(map(str, t.shape)), "dtype": str(t.dtype).removeprefix("torch.")}
                          for n, t in tensors.items()])
    out.write_csv("index.csv", index)
    out.write_json("index.json", index.to_dict(orient="records"))
    out.report(args)
    log(args, f"cached {len(cache)} activations for {len(prompts)} prompt(s), {cache.nbytes / 2**20:.2f} MiB")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_command(run, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
