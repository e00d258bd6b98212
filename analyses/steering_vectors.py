"""Contrastive steering vectors: the mean activation difference positive - negative over prompt pairs at one hook
point of one layer (CAA, Rimsky et al. 2023; ActAdd is the one-pair case), its per-pair statistics and its files.
`analyses.steering` adds one to the residual stream while the model runs."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

import pandas as pd
import plotly.graph_objects as go
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from probe.analyses.architecture import check_block_point
from probe.analyses.common import AnalysisInput, TableDisplay, is_int, model_mask, resolve_positions, tokens_and_mask
from probe import HookedDecoder
from probe.io import atomic_file
from probe.names import act_name

SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")  # the [batch pos d_model] points of a block
Position = Literal["last", "mean"]
FORMAT = "probe-steering-vector"  # the sidecar's "format", so a stray JSON file is not read as a vector


def site_name(model: HookedDecoder, site: str, layer) -> str:
    """The hook name of `site` in block `layer`, checked to be a point this model has."""
    if site not in SITES:
        raise ValueError(f"site={site!r} cannot be steered; choose one of: {', '.join(SITES)}")
    if not is_int(layer) or not 0 <= int(layer) < model.cfg.n_layers:
        raise ValueError(f"layer={layer!r} must be an int in [0, n_layers={model.cfg.n_layers})")
    name = act_name(site, int(layer))
    check_block_point(model, name, "steering site", "choose resid_pre, resid_post or attn_out")
    model.hook_point(name)  # a parallel block has no resid_mid: named here, not at the first forward
    return name


def vector_paths(path: Union[str, Path]) -> tuple[Path, Path]:
    """(the tensor file, its JSON sidecar) for `path`, which names the .safetensors file."""
    path = Path(path).expanduser()
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: a steering vector is saved as NAME.safetensors (plus NAME.json); give a path ending "
                         f"in .safetensors, e.g. {path.with_suffix('.safetensors').name}")
    return path, path.with_suffix(".json")


@dataclass(frozen=True, eq=False)
class SteeringVector(TableDisplay):
    """A direction [d_model] to add at `site` of block `layer`. From `steering_vector`, `differences` [pair d_model]
    holds each pair's positive - negative activation, of which `direction` is the mean; None otherwise."""

    direction: torch.Tensor
    layer: int
    site: str = "resid_pre"
    model_name: Optional[str] = None  # what it was computed on, as given (informational, like an SAE's)
    position: Optional[str] = None  # "last" or "mean": where in each prompt the activations were read
    differences: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.direction, torch.Tensor) and self.direction.dim() == 1 and self.direction.is_floating_point()):
            got = tuple(self.direction.shape) if isinstance(self.direction, torch.Tensor) else type(self.direction).__name__
            raise ValueError(f"direction must be a 1-D floating tensor [d_model], got {got}")
        if self.site not in SITES:
            raise ValueError(f"site={self.site!r} cannot be steered; choose one of: {', '.join(SITES)}")
        if not is_int(self.layer) or int(self.layer) < 0:
            raise ValueError(f"layer must be a non-negative int, got {self.layer!r}")
        if self.differences is not None and tuple(self.differences.shape[1:]) != (self.d_model,):
            raise ValueError(f"differences must be [pair d_model={self.d_model}], got {tuple(self.differences.shape)}")

    @property
    def d_model(self) -> int:
        return self.direction.shape[0]

    @property
    def hook_name(self) -> str:
        return act_name(self.site, self.layer)

    @property
    def norm(self) -> float:
        return float(self.direction.float().norm())

    def _require_pairs(self) -> torch.Tensor:
        if self.differences is None:
            raise ValueError("this vector keeps no per-pair differences (it was not built by steering_vector)")
        return self.differences.float()

    @property
    def pair_norms(self) -> torch.Tensor:  # [pair]
        return self._require_pairs().norm(dim=-1)

    @property
    def pair_cosines(self) -> torch.Tensor:  # [pair]: how well each pair agrees with the mean
        return torch.nn.functional.cosine_similarity(self._require_pairs(), self.direction.float()[None], dim=-1)

    @property
    def spread(self) -> float:
        """RMS distance of the pairs' differences from their mean, in the units of `norm`."""
        diffs = self._require_pairs()
        return float((diffs - self.direction.float()).norm(dim=-1).pow(2).mean().sqrt())

    def to_frame(self) -> pd.DataFrame:
        """One row per pair: its difference's norm, cosine with the mean, and projection on the mean's unit vector."""
        diffs = self._require_pairs()
        unit = self.direction.float() / max(self.norm, 1e-12)
        return pd.DataFrame({"pair": range(diffs.shape[0]), "norm": self.pair_norms.numpy(),
                             "cosine": self.pair_cosines.numpy(), "projection": (diffs @ unit).numpy()})

    def figure(self) -> go.Figure:
        frame = self.to_frame()
        fig = go.Figure(go.Bar(x=frame.pair, y=frame.cosine, customdata=frame[["norm", "projection"]].to_numpy(),
                               hovertemplate="pair %{x}<br>cosine %{y:.3f}<br>norm %{customdata[0]:.3f}"
                                             "<br>projection %{customdata[1]:.3f}<extra></extra>"))
        fig.update_layout(title=f"Steering vector at L{self.layer} {self.site}: each pair's agreement with the mean"
                                f"<br><sup>norm {self.norm:.3f}, spread {self.spread:.3f}, {len(frame)} pairs</sup>",
                          height=360, width=max(520, 160 + 12 * len(frame)))
        fig.update_xaxes(title="pair")
        fig.update_yaxes(title="cosine(pair difference, mean)", range=[-1, 1])
        return fig

    def save(self, path: Union[str, Path], overwrite: bool = False) -> tuple[Path, Path]:
        """Write NAME.safetensors (the tensors) and NAME.json (model, layer, site, d_model); returns both paths.
        Each lands complete under its final name or not at all; existing files are refused unless `overwrite`."""
        tensor_path, sidecar = vector_paths(path)
        for existing in (tensor_path, sidecar):
            if existing.exists() and not overwrite:
                raise FileExistsError(f"{existing} exists; pass overwrite=True to replace it or choose another path")
        tensors = {"direction": self.direction.detach().float().cpu().contiguous()}
        if self.differences is not None:
            tensors["differences"] = self.differences.detach().float().cpu().contiguous()
        meta = {"format": FORMAT, "version": 1, "model_name": self.model_name, "layer": int(self.layer),
                "site": self.site, "d_model": self.d_model, "position": self.position, "norm": self.norm,
                "n_pairs": None if self.differences is None else self.differences.shape[0]}
        tensor_path.parent.mkdir(parents=True, exist_ok=True)
        # both written first; then the old sidecar goes, the tensors are renamed into place and the sidecar last, so an
        # interrupted replacement leaves tensors without a sidecar (which load refuses), never an old sidecar
        # describing new tensors or a new one describing old tensors (of another layer or site, say)
        with atomic_file(sidecar, overwrite=overwrite) as tmp_meta:
            tmp_meta.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
            with atomic_file(tensor_path, overwrite=overwrite) as tmp_tensors:
                save_file(tensors, str(tmp_tensors))
                sidecar.unlink(missing_ok=True)
        return tensor_path, sidecar

    @classmethod
    def load(cls, path: Union[str, Path], model: Optional[HookedDecoder] = None) -> "SteeringVector":
        """Read a vector `save` wrote (safetensors, never pickle); with `model`, check it fits that model."""
        tensor_path, sidecar = vector_paths(path)
        for needed in (tensor_path, sidecar):
            if not needed.is_file():
                raise FileNotFoundError(f"{needed} is missing: a steering vector is {tensor_path.name} plus {sidecar.name}")
        try:
            meta = json.loads(sidecar.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{sidecar} is not valid JSON: {err}") from err
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{sidecar} is not a steering vector's sidecar (its format is not {FORMAT!r})")
        missing = [key for key in ("layer", "site", "d_model") if key not in meta]
        if missing:  # else a bare KeyError('layer'), which names neither the file nor what is wrong with it
            raise ValueError(f"{sidecar} lacks {', '.join(missing)}: it is incomplete; save the vector again")
        try:
            tensors = load_file(str(tensor_path))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"could not read the steering vector in {tensor_path}: {err}") from err
        if "direction" not in tensors or tuple(tensors["direction"].shape) != (meta.get("d_model"),):
            shape = tuple(tensors["direction"].shape) if "direction" in tensors else "no direction"
            raise ValueError(f"{tensor_path} holds {shape}, but {sidecar.name} says d_model={meta.get('d_model')}: "
                             "the two files do not belong together")
        vector = cls(direction=tensors["direction"], layer=meta["layer"], site=meta["site"],
                     model_name=meta.get("model_name"), position=meta.get("position"),
                     differences=tensors.get("differences"))
        if model is not None:
            vector.check_fits(model)
        return vector

    def check_fits(self, model: HookedDecoder) -> str:
        """The vector's hook name, once checked against the model's width, depth and hook points."""
        if self.d_model != model.cfg.d_model:
            made_for = f" (made for {self.model_name})" if self.model_name else ""
            raise ValueError(f"the steering vector has d_model={self.d_model}{made_for}, but the model has "
                             f"d_model={model.cfg.d_model}: compute a vector for this model with steering_vector")
        return site_name(model, self.site, self.layer)


def _chunks(input: AnalysisInput, what: str, size: int) -> list:
    """The prompts as batches of at most `size` (a string is one prompt)."""
    if isinstance(input, str):
        return [[input]]
    if isinstance(input, torch.Tensor):
        rows = input if input.dim() == 2 else input[None]
        return [rows[i:i + size] for i in range(0, rows.shape[0], size)]
    items = list(input)
    if not items or not all(isinstance(t, str) for t in items):
        raise ValueError(f"{what} must be a string, a non-empty list of strings or token ids [pair pos]")
    return [items[i:i + size] for i in range(0, len(items), size)]


@torch.no_grad()
def _activations(model: HookedDecoder, input: AnalysisInput, name: str, layer: int, position: str,
                 what: str, batch_size: int) -> torch.Tensor:
    """[prompt d_model] float32 on the CPU: each prompt's activation at `name`, at its last token or averaged."""
    out = []
    bos = None if model.tokenizer is None else model.tokenizer.bos_id
    for chunk in _chunks(input, what, batch_size):
        tokens, mask = tokens_and_mask(model, chunk)
        _, cache = model.run_with_cache(tokens, attention_mask=model_mask(mask), names=[name], stop_at_layer=layer + 1)
        act = cache[name].float()  # [batch pos d_model]
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        if position == "last":
            out.append(act[rows, resolve_positions(mask, -1)].cpu())
            continue
        real = mask.clone()
        if bos is not None:  # BOS reads the same everywhere: it would only shrink the mean difference
            first = resolve_positions(mask, 0)
            real[rows, first] &= tokens[rows, first] != bos
        if bool((real.sum(-1) == 0).any()):
            raise ValueError(f"a {what} prompt has no token but BOS: position='mean' needs at least one real token")
        weight = real.float() / real.float().sum(-1, keepdim=True)
        out.append(torch.einsum("bp,bpd->bd", weight, act).cpu())
    return torch.cat(out)


def steering_vector(model: HookedDecoder, positive: AnalysisInput, negative: AnalysisInput, layer: int,
                    position: Position = "last", site: str = "resid_pre", *, model_name: Optional[str] = None,
                    batch_size: int = 32) -> SteeringVector:
    """The mean over pairs (positive[i], negative[i]) of the activation difference at `site` of block `layer`:
    at each prompt's last real token (`position="last"`) or averaged over its real tokens, BOS excluded ("mean").
    Prompts are strings (one pair: ActAdd) or lists of them, or token ids [pair pos]; pairs are run in batches
    of `batch_size` prompts, padded and masked, so a prompt's activation does not depend on its batch."""
    name = site_name(model, site, layer)
    if position not in ("last", "mean"):
        raise ValueError(f"position={position!r} must be 'last' or 'mean'")
    if not is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    n_pos, n_neg = (sum(len(chunk) for chunk in _chunks(x, what, batch_size))
                    for x, what in ((positive, "positive"), (negative, "negative")))
    if n_pos != n_neg:
        raise ValueError(f"{n_pos} positive prompts but {n_neg} negative ones; the vector is the mean difference over "
                         "pairs, so give one negative per positive (trim the longer list)")
    pos = _activations(model, positive, name, int(layer), position, "positive", batch_size)
    neg = _activations(model, negative, name, int(layer), position, "negative", batch_size)
    differences = pos - neg
    return SteeringVector(direction=differences.mean(0), layer=int(layer), site=site, model_name=model_name,
                          position=position, differences=differences)


