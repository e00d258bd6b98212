"""The tuned lens (Belrose et al. 2023): one affine translator per site, trained so its residual decodes to the
model's final distribution; its small JSON config and safetensors weights, and the check that it fits a model."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from einops import einsum
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from probe.analyses.lens_sites import model_lens_sites
from probe import HookedDecoder
from probe.io import atomic_directory


LENS_CONFIG = "config.json"
LENS_WEIGHTS = "translators.safetensors"
FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TunedLensConfig:
    d_model: int
    n_layers: int
    sites: tuple[str, ...]  # one translator per site; the final residual never gets one
    model_signature: tuple[float, ...]  # cheap fingerprint of the model trained on, see model_signature_of
    training: dict = field(default_factory=dict)  # how it was trained: text, steps, seed, final KL, ...

    def to_json(self) -> str:
        values = dataclasses.asdict(self)
        values["sites"], values["model_signature"] = list(self.sites), list(self.model_signature)
        return json.dumps({"format_version": FORMAT_VERSION, **values}, indent=2) + "\n"


def model_signature_of(model: HookedDecoder) -> tuple[float, ...]:
    """A few weight statistics: tells a lens trained on another checkpoint apart, survives dtype changes."""
    with torch.no_grad():
        tensors = [model.embed.W_E[:8]] + list(model.blocks[-1].parameters()) + list(model.ln_final.parameters())
        return tuple(round(float(t.double().norm()), 6) for t in tensors)


class TunedLens(nn.Module):
    """One affine translator per site, `h + h A + b`, A and b zero at initialisation (the logit lens).

    Works on tensors: `lens(resid, sites)` translates residuals [batch layer pos d_model] read at `sites`.
    """

    def __init__(self, config: TunedLensConfig):
        super().__init__()
        self.config = config
        n = len(config.sites)
        self.A = nn.Parameter(torch.zeros(n, config.d_model, config.d_model))  # [layer d_model d_model]
        self.b = nn.Parameter(torch.zeros(n, config.d_model))  # [layer d_model]

    @classmethod
    def for_model(cls, model: HookedDecoder, include_mid: bool = False, training: Optional[dict] = None) -> "TunedLens":
        sites = tuple(model_lens_sites(model, include_mid)[:-1])
        cfg = TunedLensConfig(d_model=model.cfg.d_model, n_layers=model.cfg.n_layers, sites=sites,
                              model_signature=model_signature_of(model), training=dict(training or {}))
        return cls(cfg).to(model.device)

    @property
    def sites(self) -> tuple[str, ...]:
        return self.config.sites

    def forward(self, resid: torch.Tensor, sites: Sequence[str]) -> torch.Tensor:
        index = [self._index(s) for s in sites]
        # a lens loaded on the CPU reads a model's residuals wherever they are
        A, b = self.A[index].to(resid.device, resid.dtype), self.b[index].to(resid.device, resid.dtype)
        return resid + einsum(resid, A, "batch layer pos d_model, layer d_model d_out -> batch layer pos d_out") + b[:, None]

    def _index(self, site: str) -> int:
        try:
            return self.config.sites.index(site)
        except ValueError:
            hint = " (train it with include_mid=True to read hook_resid_mid)" if "resid_mid" in site else ""
            raise ValueError(f"this tuned lens has no translator for {site}{hint}; it has: {', '.join(self.sites)}") from None

    def check_compatible(self, model: HookedDecoder, sites: Sequence[str] = ()) -> None:
        cfg = self.config
        if (cfg.d_model, cfg.n_layers) != (model.cfg.d_model, model.cfg.n_layers):
            raise ValueError(
                f"this tuned lens was trained for d_model={cfg.d_model}, n_layers={cfg.n_layers}; the model has "
                f"d_model={model.cfg.d_model}, n_layers={model.cfg.n_layers}"
            )
        ours, theirs = torch.tensor(cfg.model_signature), torch.tensor(model_signature_of(model))
        if not torch.allclose(ours, theirs, rtol=1e-2, atol=1e-3):
            raise ValueError("this tuned lens was trained on a different checkpoint (its weight fingerprint differs); "
                             "train one for this model with train_tuned_lens")
        for site in sites[:-1]:
            self._index(site)

    # ---- saving and loading: safetensors + JSON, never pickle ----
    def save(self, directory: Union[str, Path], overwrite: bool = False) -> Path:
        """Write `config.json` and `translators.safetensors` into a new directory (e.g. next to the model's).

        Written to a temporary sibling and renamed into place; an existing path is replaced only with overwrite=True.
        """
        with atomic_directory(directory, overwrite=overwrite) as tmp:
            (tmp / LENS_CONFIG).write_text(self.config.to_json())
            tensors = {"A": self.A.detach().float().cpu().contiguous(), "b": self.b.detach().float().cpu().contiguous()}
            save_file(tensors, str(tmp / LENS_WEIGHTS), metadata={"format": "pt"})
        return Path(directory).expanduser()

    @classmethod
    def load(cls, directory: Union[str, Path], model: Optional[HookedDecoder] = None) -> "TunedLens":
        """Read a lens written by `save`; with `model`, check it was trained on that model and move it there."""
        directory = Path(directory).expanduser()
        config_path, weights_path = directory / LENS_CONFIG, directory / LENS_WEIGHTS
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: a tuned-lens directory holds {LENS_CONFIG} and {LENS_WEIGHTS}")
        try:
            values = json.loads(config_path.read_text())
            version = values.pop("format_version", None)
            if version != FORMAT_VERSION:
                raise ValueError(f"format_version {version!r}, expected {FORMAT_VERSION}")
            config = TunedLensConfig(**{**values, "sites": tuple(values["sites"]),
                                        "model_signature": tuple(values["model_signature"])})
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, ValueError) as err:
            raise ValueError(f"{config_path} is not a tuned-lens config: {err}") from err
        try:
            tensors = load_file(str(weights_path))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"could not read {weights_path}: {err}") from err
        lens = cls(config)
        shapes = {"A": tuple(lens.A.shape), "b": tuple(lens.b.shape)}
        got = {k: tuple(v.shape) for k, v in tensors.items()}
        if got != shapes:
            raise ValueError(f"{weights_path} holds tensors {got}; its config implies {shapes}")
        with torch.no_grad():
            lens.A.copy_(tensors["A"])
            lens.b.copy_(tensors["b"])
        if model is not None:
            lens.check_compatible(model)
            lens = lens.to(model.device)
        return lens
