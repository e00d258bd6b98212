"""Sparse autoencoders on one hook point, in SAELens's file format, and splicing them into a model.

An SAE reads an activation x [... d_in] and writes it back as a sparse sum of learned directions:

    x' = x - b_dec (when apply_b_dec_to_input)     hook_sae_input is x
    pre = x' W_enc + b_enc                          hook_sae_acts_pre   [... d_sae]
    features = act(pre)                             hook_sae_acts_post  [... d_sae]
    reconstruction = features W_dec + b_dec        hook_sae_recons     [... d_in]

with act ReLU ("standard"), ReLU where pre > threshold ("jumprelu", Gemma Scope), or ReLU of the k
largest ("topk"). An SAE on `hook_z` reads the heads flattened, [... (head d_head)].

A transcoder (`hook_name_out` and `d_out` set) reads one hook point and predicts another, typically an
MLP's input `blocks.L.ln2.hook_normalized` and its output `blocks.L.hook_mlp_out`: the same encoder, a
decoder W_dec [d_sae d_out] + b_dec [d_out] into the output's space, b_dec never subtracted from the input
(SAELens refuses apply_b_dec_to_input for transcoders), and for a skip-transcoder a linear path
x W_skip^T (W_skip [d_out d_in]) added to the reconstruction.

`spliced(model, sae)` replaces the model's activation at `sae.cfg.hook_name` by the SAE's output for
the duration of a `with` block, and lends the SAE's hook points to the model under
`<hook_name>.hook_sae_acts_post` and so on (SAELens's names), so `run_with_cache` and hooks reach the
features. With `use_error_term=True` the output adds back what the SAE misses, x - reconstruction
(computed without hooks, `hook_sae_error`): the model then computes exactly what it did without the
SAE, and an edit of the features changes it by exactly the edit's decoded difference.

The configuration (`SAEConfig`) and the reading of SAELens's cfg.json live in `probe.sae_config`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
from einops import rearrange
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from probe.hooks import HookedRootModule, HookPoint, observed
from probe.io import atomic_directory
from probe.sae_config import ARCHITECTURES, TRANSCODER_NAMES, Architecture, SAEConfig, check_weights, config_from_saelens

__all__ = ["ARCHITECTURES", "Architecture", "BUNDLED_SAES", "CONFIG_FILE", "SAEConfig", "SparseAutoencoder", "TRANSCODER_NAMES",
           "WEIGHTS_FILE", "spliced"]

CONFIG_FILE, WEIGHTS_FILE = "cfg.json", "sae_weights.safetensors"  # SAELens's names
# dictionaries trained on the bundled model (probe.DEFAULT_MODEL), one folder each; see docs/sae_training.md
BUNDLED_SAES = Path(__file__).resolve().parent / "data" / "saes"


class SparseAutoencoder(HookedRootModule):
    """See the module docstring. Parameters in SAELens's names and shapes: W_enc [d_in d_sae], b_enc [d_sae],
    W_dec [d_sae d_in], b_dec [d_in], and threshold [d_sae] for jumprelu; a transcoder's W_dec and b_dec have
    d_out columns, and a skip-transcoder adds W_skip [d_out d_in]."""

    def __init__(self, cfg: SAEConfig):
        super().__init__()
        self.cfg = cfg
        self.hook_z_reshaping_mode = cfg.reshape_activations == "hook_z"  # SAELens's switch (sae-dashboard reads it)
        self.W_enc = nn.Parameter(torch.zeros(cfg.d_in, cfg.d_sae))
        self.b_enc = nn.Parameter(torch.zeros(cfg.d_sae))
        self.W_dec = nn.Parameter(torch.zeros(cfg.d_sae, cfg.d_write))
        self.b_dec = nn.Parameter(torch.zeros(cfg.d_write))
        self.threshold = nn.Parameter(torch.zeros(cfg.d_sae)) if cfg.architecture == "jumprelu" else None
        self.W_skip = nn.Parameter(torch.zeros(cfg.d_write, cfg.d_in)) if cfg.skip else None
        self.hook_sae_input = HookPoint()  # [... d_in]
        self.hook_sae_acts_pre = HookPoint()  # [... d_sae]
        self.hook_sae_acts_post = HookPoint()  # [... d_sae]: the features
        self.hook_sae_recons = HookPoint()  # [... d_in]
        self.hook_sae_error = HookPoint()  # [... d_in]: x - reconstruction, with use_error_term
        self.hook_sae_output = HookPoint()  # [... d_in]: what the model receives when spliced
        self.use_error_term = False  # SAELens's setting: what a splice uses when not told (use_error_term=None)
        self.setup_hooks()
        # each point's last dimension, for a model's cache-size estimate (a hook_z SAE's error and output keep
        # the heads, [... head d_head], the same number of elements as d_in)
        for name, point in self._hook_points.items():
            point.width = cfg.d_sae if name.startswith("hook_sae_acts") else cfg.d_in if name == "hook_sae_input" \
                else cfg.d_write

    # ---- the SAE itself --------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Features [... d_sae] of activations [... d_in] (a hook_z SAE: [... head d_head])."""
        return self._encode(x, hooked=True)

    def feature_activations(self, x: torch.Tensor, features: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[... feature]: the activations of the `features` [feature] only (None: all), without hooks. A standard
        or JumpReLU feature depends on its own encoder column alone, so a wide SAE's other columns are never
        computed; a TopK feature depends on all of them (the k largest), so those are encoded whole."""
        if features is None or self.cfg.architecture == "topk":
            encoded = self._encode(x, hooked=False)
            return encoded if features is None else encoded[..., features]
        x = self._flat(x).to(self.W_enc.dtype)
        return self._activate(self._pre(x, features), features)

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        """Reconstruction [... d_in] of features [... d_sae] (a transcoder's prediction [... d_out], without
        a skip-transcoder's linear path, which reads the input: see `forward`). A hook_z SAE's comes back per head,
        [... head d_head], as SAELens's does, once it has encoded an activation (which tells it d_head);
        `hook_sae_recons` holds it flattened either way."""
        recons = self.hook_sae_recons(features @ self.W_dec + self.b_dec)
        d_head = getattr(self, "d_head", None)
        return recons if d_head is None else rearrange(recons, "... (head d_head) -> ... head d_head", d_head=d_head)

    def forward(self, x: torch.Tensor, use_error_term: bool = False, target: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The SAE's output for activations x, in x's shape (a hook_z SAE's error and output keep the heads,
        [... head d_head], as SAELens's do), dtype and device. A transcoder's output is its prediction
        [... d_out]; its error term needs `target`, the true activation at hook_name_out."""
        if self.cfg.is_transcoder:
            shape = (*x.shape[:-1], self.cfg.d_out)
            if use_error_term and target is None:
                raise ValueError("a transcoder's error term is target - prediction: pass target, the activation at "
                                 f"{self.cfg.hook_name_out!r}")
        else:
            shape, target = x.shape, x
        output = (self.decode(self.encode(x)) + self._skip(x)).reshape(shape)
        if use_error_term:
            with torch.no_grad():  # the error is a constant: an edit of the features acts on the reconstruction alone
                edited = any(observed(p) for p in (self.hook_sae_input, self.hook_sae_acts_pre, self.hook_sae_acts_post,
                                                self.hook_sae_recons))
                # without hooks the reconstruction is the clean one: the same operations, so no second encode
                clean = (self._encode(x, hooked=False) @ self.W_dec + self.b_dec + self._skip(x)).reshape(shape) \
                    if edited else output.detach()
                # in the wider of the two dtypes: a bfloat16 SAE must not round a float32 model's activation
                dtype = torch.promote_types(target.dtype, clean.dtype)
                error = target.to(dtype) - clean.to(dtype)
            output = output.to(dtype) + self.hook_sae_error(error)
        return self.hook_sae_output(output).to(x.dtype)

    def _skip(self, x: torch.Tensor):
        """A skip-transcoder's linear path x W_skip^T [... d_out]; 0 otherwise."""
        return 0 if self.W_skip is None else self._flat(x).to(self.W_skip.dtype) @ self.W_skip.T

    def _flat(self, x: torch.Tensor) -> torch.Tensor:
        # hook_z: [... head d_head], or heads flattened already (sae-dashboard's); decode gives back the shape given
        if self.cfg.hook_name.endswith("hook_z"):
            flat = x.shape[-1] == self.cfg.d_in
            self.d_head = None if flat else x.shape[-1]  # SAELens's attribute: what decode unflattens to
            x = x if flat else rearrange(x, "... head d_head -> ... (head d_head)")
        if x.shape[-1] != self.cfg.d_in:
            raise ValueError(f"the SAE reads {self.cfg.d_in} dimensions, but the activation at {self.cfg.hook_name!r} "
                             f"has {x.shape[-1]}: it was trained for another model or hook point")
        return x

    def _encode(self, x: torch.Tensor, hooked: bool) -> torch.Tensor:
        observe = (lambda point, t: point(t)) if hooked else (lambda point, t: t)  # noqa: E731
        x = observe(self.hook_sae_input, self._flat(x).to(self.W_enc.dtype))
        pre = observe(self.hook_sae_acts_pre, self._pre(x))
        return observe(self.hook_sae_acts_post, self._activate(pre))

    def _pre(self, x: torch.Tensor, features=slice(None)) -> torch.Tensor:
        """Pre-activations [... feature] of flattened inputs, for `features` (all by default)."""
        x = x - self.b_dec if self.cfg.apply_b_dec_to_input else x  # a transcoder's b_dec is in the output space
        return x @ self.W_enc[:, features] + self.b_enc[features]

    def _activate(self, pre: torch.Tensor, features=slice(None)) -> torch.Tensor:
        """The activation function on pre-activations of `features` (their thresholds, for JumpReLU)."""
        if self.cfg.architecture == "jumprelu":
            return torch.relu(pre) * (pre > self.threshold[features])
        if self.cfg.architecture == "topk":
            top = pre.topk(self.cfg.k, dim=-1)
            return torch.zeros_like(pre).scatter(-1, top.indices, torch.relu(top.values))
        return torch.relu(pre)

    def digest(self) -> str:
        """A short fingerprint of the config and every weight: two SAEs at one hook point (Gemma Scope ships several
        widths and sparsities per layer) have different digests, so their results are never mixed."""
        settings = {k: v for k, v in dataclasses.asdict(self.cfg).items() if k not in ("file_metadata", "dtype", "device")}
        fingerprint = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
        for name, param in sorted(self.named_parameters()):
            data = param.detach().cpu().contiguous()
            fingerprint.update(f"{name} {data.dtype} {tuple(data.shape)}".encode())
            fingerprint.update(memoryview(data.view(torch.uint8).numpy()))  # the bytes as they are, without a copy
        return fingerprint.hexdigest()[:16]

    # ---- SAELens 6's surface ------------------------------------------------------------------------------
    def _apply(self, fn, *args, **kwargs):
        # .to() / .half(): cfg.dtype and cfg.device follow the weights, as SAELens code reads them off the config
        out = super()._apply(fn, *args, **kwargs)
        dtype, device = str(self.W_enc.dtype).removeprefix("torch."), str(self.W_enc.device)
        if (dtype, device) != (self.cfg.dtype, self.cfg.device):
            self.cfg = dataclasses.replace(self.cfg, dtype=dtype, device=device)
        return out

    def get_W_dec_norm(self) -> torch.Tensor:
        """[d_sae]: each feature's decoder norm (SAELens's)."""
        return self.W_dec.norm(dim=-1).clamp(min=1e-8)

    def get_name(self) -> str:
        """SAELens's name for the SAE: sae_<model>_<hook>_<d_sae>."""
        return f"sae_{self.cfg.model_name}_{self.cfg.hook_name}_{self.cfg.d_sae}"

    def save_model(self, path: Union[str, Path]) -> tuple[Path, Path]:
        """SAELens's `save_model(path)`: `save_pretrained(path)` (a new directory: an existing one is refused, never
        overwritten silently; `save_pretrained(path, overwrite=True)` replaces it); (weights path, cfg.json path)."""
        directory = self.save_pretrained(path)
        return directory / WEIGHTS_FILE, directory / CONFIG_FILE

    def turn_on_forward_pass_hook_z_reshaping(self) -> None:
        """SAELens's switch, recorded (`hook_z_reshaping_mode`): probe's reads heads apart or flattened either way."""
        if not self.cfg.hook_name.endswith("_z"):
            raise ValueError(f"hook_z reshaping is for SAEs on attention's hook_z; this one reads {self.cfg.hook_name!r}")
        self.hook_z_reshaping_mode = True

    def turn_off_forward_pass_hook_z_reshaping(self) -> None:
        self.hook_z_reshaping_mode = False

    @property
    def device(self) -> torch.device:  # SAELens's sae.device and sae.dtype
        return self.W_enc.device

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @torch.no_grad()
    def fold_W_dec_norm(self) -> None:
        """SAELens's: each decoder row scaled to unit norm and its norm folded into the encoder (the feature's W_enc
        column, b_enc entry and JumpReLU threshold), so the output is unchanged and each feature reads in units of
        its decoder norm. Refused for TopK, where scaling the pre-activations changes which k win (as SAELens's)."""
        if self.cfg.architecture == "topk":
            raise NotFoldable("fold_W_dec_norm would change which k features a TopK SAE keeps (the pre-activations are "
                              "rescaled per feature); it folds standard and jumprelu SAEs only")
        norms = self.W_dec.norm(dim=-1).clamp(min=1e-8)  # [d_sae]
        self.W_dec.div_(norms[:, None])
        self.W_enc.mul_(norms)
        self.b_enc.mul_(norms)
        if self.threshold is not None:
            self.threshold.mul_(norms)

    # ---- files -----------------------------------------------------------------------------------------
    @classmethod
    def load_from_disk(cls, path: Union[str, Path], device: Optional[Union[str, torch.device]] = None,
                       dtype: Optional[Union[str, torch.dtype]] = None, converter=None,
                       fold_W_dec_norm: bool = False) -> "SparseAutoencoder":
        """SAELens 6's `SAE.load_from_disk(path, device, dtype, fold_W_dec_norm=)`: `from_pretrained(directory)`,
        `dtype` a torch dtype or SAELens's name for one ("float32", "bfloat16", ...)."""
        if converter is not None:
            raise TypeError("converter= is SAELens's hook for other file formats; probe reads SAELens's directory format "
                            "(cfg.json, sae_weights.safetensors): convert with SAELens and save_model() there")
        if isinstance(dtype, str):
            named = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(named, torch.dtype):
                raise ValueError(f"dtype={dtype!r} names no torch dtype; give e.g. 'float32' or 'bfloat16'")
            dtype = named
        sae = cls.from_pretrained(path, device=device, dtype=dtype)
        if fold_W_dec_norm:
            sae.fold_W_dec_norm()
        return sae

    @classmethod
    def from_pretrained(cls, directory: Union[str, Path], device: Optional[Union[str, torch.device]] = None,
                        dtype: Optional[torch.dtype] = None) -> "SparseAutoencoder":
        """Read an SAELens directory (cfg.json and sae_weights.safetensors), as SAELens 3 to 6 write them."""
        directory = Path(directory).expanduser()
        config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
        for path in (config_path, weights_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing: an SAE directory holds {CONFIG_FILE} and {WEIGHTS_FILE}")
        try:
            raw = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{config_path} is not valid JSON: {err}") from err
        except RecursionError:
            raise ValueError(f"{config_path} is nested too deeply to be an SAE configuration") from None
        try:
            state = load_file(str(weights_path))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"could not read the SAE weights in {weights_path}: {err}") from err
        return cls.from_saelens_state(raw, state, config_path, weights_path).to(device=device, dtype=dtype)

    @classmethod
    def from_saelens(cls, sae: torch.nn.Module) -> "SparseAutoencoder":
        """probe's copy of an SAE object of SAELens (`sae_lens.SAE.from_pretrained(...)`'s), on its device and in its
        dtype, its `use_error_term` too: SAELens code hands its SAEs to HookedSAETransformer's methods, and probe's
        take them so (tests/test_sae_methods.py runs SAELens's objects on probe against HookedSAETransformer)."""
        state = {name: tensor.detach() for name, tensor in sae.state_dict().items()}
        where = Path(f"<{type(sae).__name__} object>")
        ours = cls.from_saelens_state(sae.cfg.to_dict(), state, where, where)
        ours.use_error_term = bool(getattr(sae, "use_error_term", False))
        weight = next(sae.parameters())
        return ours.to(device=weight.device, dtype=weight.dtype)

    @classmethod
    def from_saelens_state(cls, raw: dict, state: dict[str, torch.Tensor], config_path: Path,
                           weights_path: Path) -> "SparseAutoencoder":
        """An SAE from SAELens's settings (cfg.json's dict) and weights; the paths name them in errors."""
        cfg = config_from_saelens(raw, config_path)
        check_weights(state, weights_path)
        if "log_threshold" in state and cfg.architecture == "jumprelu":  # a training checkpoint's parametrisation
            state["threshold"] = state.pop("log_threshold").exp()
        scaling = state.pop("scaling_factor", None)  # some SAELens versions saved a (fine-tuning) scale
        if scaling is not None and not bool((scaling == 1).all()):
            raise ValueError(f"{weights_path} has a scaling_factor other than 1 (a fine-tuned scale on the features); "
                             "fold it into W_dec first (W_dec * scaling_factor[:, None])")
        sae = cls(cfg)
        expected = {name: tuple(p.shape) for name, p in sae.named_parameters()}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        wrong = [f"{n} {tuple(state[n].shape)} (expected {expected[n]})" for n in expected
                 if n in state and tuple(state[n].shape) != expected[n]]
        if missing or unexpected or wrong:
            kind = f"{cfg.architecture} {'skip-transcoder' if cfg.skip else 'transcoder'} with d_out={cfg.d_out}, " \
                if cfg.is_transcoder else f"{cfg.architecture} SAE with "
            raise ValueError(f"{weights_path} does not fit a {kind}d_in={cfg.d_in}, d_sae={cfg.d_sae}: "
                             + "; ".join(filter(None, [missing and f"missing {', '.join(missing)}",
                                                       unexpected and f"unexpected {', '.join(unexpected)}",
                                                       wrong and f"misshapen {', '.join(wrong)}"])))
        sae.load_state_dict(state)
        return sae

    def save_pretrained(self, directory: Union[str, Path], overwrite: bool = False) -> Path:
        """Write cfg.json and sae_weights.safetensors (loadable here and by SAELens); written whole or not at all."""
        # the weights' own dtype (a parameter replaced by hand bypasses .to()), written from the CPU
        config = {**self.cfg.to_dict(), "dtype": str(self.W_enc.dtype).removeprefix("torch."), "device": "cpu"}
        state = {name: p.detach().cpu().contiguous() for name, p in self.named_parameters()}
        with atomic_directory(directory, overwrite=overwrite) as tmp:
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
            save_file(state, str(tmp / WEIGHTS_FILE))
        return Path(directory).expanduser()



class NotFoldable(ValueError, NotImplementedError):
    """fold_W_dec_norm refused: a ValueError, and the NotImplementedError SAELens raises there."""


@contextmanager
def spliced(model: HookedRootModule, saes: Union[SparseAutoencoder, Sequence[SparseAutoencoder]],
            use_error_term: Optional[bool] = False) -> Iterator[HookedRootModule]:
    """Inside the block, each SAE's output replaces the model's activation at its hook point (a transcoder's
    prediction replaces the activation at its hook_name_out), and the SAE's hook points are the model's, named
    `<hook_name>.hook_sae_acts_post` etc. (a transcoder's `<hook_name_out>.hook_sae_acts_post`, as SAELens names them). Hooks on the hook point itself attached inside the block see the
    SAE's output. Everything is undone on exit, whatever happens. `use_error_term=None`: each SAE's own
    `sae.use_error_term`, as SAELens reads it."""
    saes = [saes] if isinstance(saes, SparseAutoencoder) else list(saes)
    for names in ([sae.cfg.hook_name for sae in saes],
                  [sae.cfg.hook_name_out if sae.cfg.is_transcoder else sae.cfg.hook_name for sae in saes]):
        if len(set(names)) != len(names):
            raise ValueError(f"two SAEs read or write the same hook point "
                             f"({', '.join(sorted(n for n in set(names) if names.count(n) > 1))}); splice one per point")
    with ExitStack() as stack:
        for sae in saes:
            stack.callback(attach(model, sae, use_error_term, permanent=False))
        yield model


def attach(model: HookedRootModule, sae: SparseAutoencoder, use_error_term: Optional[bool] = None, *,
           permanent: bool = True) -> Callable[[], None]:
    """Splice `sae` into `model` (as `spliced` does) until the returned function is called: SAELens's `add_sae`.
    Its hooks are `permanent` ones, which `model.reset_hooks()` keeps and `model.persistent_hooks()` lists;
    `permanent=False` gives scoped ones, for a block (`spliced`)."""
    model.hook_point(sae.cfg.hook_name)  # a misspelt or foreign hook point fails here, named
    if sae.cfg.is_transcoder:
        model.hook_point(sae.cfg.hook_name_out)
    error_term = sae.use_error_term if use_error_term is None else bool(use_error_term)
    lending = ExitStack()
    lending.enter_context(model.lent_hook_points({f"{sae.cfg.written_hook_name}.{name}": point
                                                 for name, point in sae._hook_points.items()}))
    try:
        handles = [model.hook_point(name).add(fn, persistent=permanent, permanent=permanent)
                   for name, fn in _splice_hooks(sae, error_term)]
    except BaseException:
        lending.close()
        raise

    def detach() -> None:
        for handle in reversed(handles):
            handle.remove()
        lending.close()

    return detach


def _splice_hooks(sae: SparseAutoencoder, use_error_term: bool) -> list:
    if not sae.cfg.is_transcoder:
        def replace(activation: torch.Tensor, hook: HookPoint) -> torch.Tensor:
            return sae(activation.to(sae.W_enc.device), use_error_term=use_error_term).to(activation.device)

        replace.__name__ = f"sae on {sae.cfg.hook_name}"
        return [(sae.cfg.hook_name, replace)]
    read = {}  # the input seen in this forward, until the output point uses it

    def keep(activation: torch.Tensor, hook: HookPoint) -> None:
        read["x"] = activation

    def predict(activation: torch.Tensor, hook: HookPoint) -> torch.Tensor:
        if "x" not in read:
            raise RuntimeError(f"the transcoder's output point {sae.cfg.hook_name_out!r} ran before its input point "
                               f"{sae.cfg.hook_name!r}: the input must come first in the forward pass")
        x = read.pop("x").to(sae.W_enc.device)
        target = activation.to(sae.W_enc.device) if use_error_term else None
        return sae(x, use_error_term=use_error_term, target=target).to(activation.device, activation.dtype)

    keep.__name__ = f"transcoder input at {sae.cfg.hook_name}"
    predict.__name__ = f"transcoder {sae.cfg.hook_name} -> {sae.cfg.hook_name_out}"
    return [(sae.cfg.hook_name, keep), (sae.cfg.hook_name_out, predict)]
