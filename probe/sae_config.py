"""A sparse autoencoder's (or transcoder's) configuration, validated, and how it is read from SAELens's files:
`cfg.json` into an `SAEConfig` (`config_from_saelens`), and the weights' checks (`check_weights`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import torch

Architecture = Literal["standard", "jumprelu", "topk"]
ARCHITECTURES = ("standard", "jumprelu", "topk")
# SAELens's architecture names for transcoders: (activation, skip) -> name. SAELens 6 has no TopK transcoder;
# probe writes one as "topk_transcoder", a name only probe reads.
TRANSCODER_NAMES = {("standard", False): "transcoder", ("standard", True): "skip_transcoder",
                    ("jumprelu", False): "jumprelu_transcoder", ("jumprelu", True): "jumprelu_skip_transcoder",
                    ("topk", False): "topk_transcoder", ("topk", True): "topk_skip_transcoder"}


class ArchitectureName(str):
    """probe's architecture name ("standard", "jumprelu", "topk"), also callable as SAELens 6's
    `cfg.architecture()`, which gives SAELens's name (a transcoder's: "jumprelu_skip_transcoder", ...)."""

    saelens_name: str

    def __new__(cls, name: str, saelens_name: Optional[str] = None) -> "ArchitectureName":
        made = super().__new__(cls, name)
        made.saelens_name = saelens_name or name
        return made

    def __call__(self) -> str:
        return self.saelens_name

    def __reduce__(self):
        return ArchitectureName, (str(self), self.saelens_name)


class SAEMetadata:
    """SAELens 6's `cfg.metadata`: what the SAE's file says of how it was made (hook_name, model_name, hook_layer,
    prepend_bos, context_size, dataset_path, ...), by attribute or key; a name it does not hold reads None, as
    SAELens's does (so SAELens's ActivationsStore and evals read probe's SAEs)."""

    def __init__(self, **fields: Any):
        self.__dict__.update(fields)

    def __getattr__(self, name: str) -> None:
        if name.startswith("__"):  # copy and pickle look up protocol methods: those are really absent
            raise AttributeError(name)
        return None

    def __getitem__(self, key: str) -> Any:
        return self.__dict__.get(key)

    def __contains__(self, key: str) -> bool:
        return key in self.__dict__

    def get(self, key: str, default: Any = None) -> Any:
        return self.__dict__.get(key, default)

    def keys(self):
        return self.__dict__.keys()

    def items(self):
        return self.__dict__.items()

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SAEMetadata) and self.__dict__ == other.__dict__

    def __repr__(self) -> str:
        return f"SAEMetadata({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"


@dataclass(frozen=True, kw_only=True)
class SAEConfig:
    d_in: int
    d_sae: int
    hook_name: str  # where it reads and writes, e.g. "blocks.8.hook_resid_pre"
    architecture: Architecture = "standard"
    k: Optional[int] = None  # topk: how many features stay on
    apply_b_dec_to_input: bool = True
    model_name: Optional[str] = None  # what it was trained on, as its file says (not checked)
    hook_name_out: Optional[str] = None  # a transcoder: the hook point it predicts, e.g. "blocks.2.hook_mlp_out"
    d_out: Optional[int] = None  # a transcoder: the width of hook_name_out
    skip: bool = False  # a skip-transcoder: adds x W_skip^T
    # the rest of the file's metadata (hook_layer, prepend_bos, context_size, ...), kept for cfg.metadata and for
    # saving; (key, value) pairs, left out of equality and hashing
    file_metadata: tuple = dataclasses.field(default=(), compare=False, hash=False)
    # SAELens 6's cfg.dtype and cfg.device: the weights' (SparseAutoencoder keeps them current)
    dtype: str = dataclasses.field(default="float32", compare=False)
    device: str = dataclasses.field(default="cpu", compare=False)

    @property
    def is_transcoder(self) -> bool:
        return self.hook_name_out is not None

    @property
    def metadata(self) -> SAEMetadata:
        """SAELens 6's `cfg.metadata` (code reads `sae.cfg.metadata.hook_name`, SAELens's ActivationsStore
        `metadata.prepend_bos`): the file's metadata, with probe's own fields under their names."""
        own = {"model_name": self.model_name, "hook_name": self.hook_name, "hook_name_out": self.hook_name_out}
        return SAEMetadata(**{**dict(self.file_metadata), **own})

    @property
    def normalize_activations(self) -> str:  # SAELens 6's field: probe runs activations as they come
        return "none"

    @property
    def reshape_activations(self) -> str:
        """SAELens 6's: "hook_z" for an SAE on attention's hook_z (it reads the heads flattened), else "none"."""
        return "hook_z" if "hook_z" in self.hook_name else "none"

    def to_dict(self) -> dict[str, Any]:
        """The settings as SAELens's cfg.json holds them (what save_pretrained writes)."""
        metadata = {**dict(self.file_metadata), "hook_name": self.hook_name, "model_name": self.model_name}
        config = {"architecture": self.architecture(), "d_in": self.d_in, "d_sae": self.d_sae, "dtype": self.dtype,
                  "device": self.device, "apply_b_dec_to_input": self.apply_b_dec_to_input,
                  "normalize_activations": "none", "reshape_activations": self.reshape_activations,
                  "hook_name": self.hook_name, "metadata": metadata, **({"k": self.k} if self.k is not None else {})}
        if self.is_transcoder:  # SAELens reads d_out at the top level and keeps hook_name_out in its metadata
            config.update(d_out=self.d_out, hook_name_out=self.hook_name_out)
            metadata["hook_name_out"] = self.hook_name_out
        return config

    @property
    def written_hook_name(self) -> str:
        """The point it writes (hook_name_out for a transcoder), under which a splice names its hook points
        (`<written_hook_name>.hook_sae_acts_post`), as SAELens does."""
        return self.hook_name_out if self.is_transcoder else self.hook_name

    @property
    def d_write(self) -> int:
        """The width of what it writes: d_out for a transcoder, d_in for an SAE."""
        return self.d_out if self.is_transcoder else self.d_in

    def __post_init__(self) -> None:
        for field in ("d_in", "d_sae"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"SAE architecture {self.architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
        saelens_name = TRANSCODER_NAMES[self.architecture, self.skip] if self.hook_name_out is not None else None
        object.__setattr__(self, "architecture", ArchitectureName(str(self.architecture), saelens_name))
        if self.architecture == "topk":
            if not (isinstance(self.k, int) and 0 < self.k <= self.d_sae):
                raise ValueError(f"a topk SAE needs k, an int in [1, d_sae={self.d_sae}], got {self.k!r}")
        elif self.k is not None:
            raise ValueError(f"k={self.k!r} applies only to architecture='topk'")
        if not isinstance(self.hook_name, str) or not self.hook_name:
            raise ValueError(f"hook_name must name the model's hook point it reads, got {self.hook_name!r}")
        if (self.hook_name_out is None) != (self.d_out is None):
            raise ValueError(f"a transcoder needs both hook_name_out and d_out (got hook_name_out={self.hook_name_out!r}, "
                             f"d_out={self.d_out!r}); an SAE has neither")
        if self.is_transcoder:
            if not isinstance(self.d_out, int) or isinstance(self.d_out, bool) or self.d_out <= 0:
                raise ValueError(f"d_out must be a positive int, got {self.d_out!r}")
            if self.apply_b_dec_to_input:
                raise ValueError("a transcoder's b_dec lives in the output's space: pass apply_b_dec_to_input=False")
            if self.hook_name.endswith("hook_z") or self.hook_name_out.endswith("hook_z"):
                raise ValueError("transcoders read and write one vector per position; hook_z (per head) is not supported")
        elif self.skip:
            raise ValueError("skip=True is a skip-transcoder's linear path; an SAE (no hook_name_out) has none")


def check_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """Float tensors without NaN or inf, so a broken file is named here rather than its hook point later."""
    for name, tensor in state.items():
        if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise ValueError(f"{path}: the tensor {name!r} is stored as {str(tensor.dtype).removeprefix('torch.')}; "
                             "SAE weights must be float16, bfloat16, float32 or float64")
        low, high = torch.aminmax(tensor) if tensor.numel() else (tensor.new_zeros(()), tensor.new_zeros(()))
        if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
            raise ValueError(f"{path}: the tensor {name!r} contains NaN or inf values: the SAE file is corrupt")


# the cfg.json fields read, and the JSON type each must have (None, a field left out, is always allowed)
SAE_FIELD_TYPES = {"metadata": dict, "meta": dict, "architecture": str, "activation_fn_kwargs": dict,
                    "activation_fn_str": str, "activation_fn": str, "normalize_activations": str,
                    "apply_b_dec_to_input": bool, "rescale_acts_by_decoder_norm": bool, "hook_name": str,
                    "hook_point": str, "hook_name_out": str, "model_name": str}


def check_sae_fields(raw, path: Path) -> None:
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object of settings, got a {type(raw).__name__}")
    for source, where in ((raw, ""), (raw.get("metadata"), "metadata."), (raw.get("meta"), "meta.")):
        if not isinstance(source, dict):
            continue
        for key, kind in SAE_FIELD_TYPES.items():
            value = source.get(key)
            if value is not None and not isinstance(value, kind):
                says = {dict: "an object", str: "a string", bool: "true or false (JSON's, unquoted)"}[kind]
                raise ValueError(f"{path}: {where}{key} must be {says}, got {value!r:.60}")


def config_from_saelens(raw: dict, path: Path) -> SAEConfig:
    check_sae_fields(raw, path)
    meta = {**(raw.get("metadata") or {}), **(raw.get("meta") or {})}  # SAELens 6 nests these; older files do not
    # SAELens before 3 said hook_point
    hook_name = raw.get("hook_name") or meta.get("hook_name") or raw.get("hook_point")
    if hook_name is None:
        raise ValueError(f"{path} names no hook_name: which activation the SAE reads is unknown")
    if any(source.get(key) is not None for source in (raw, meta) for key in ("hook_head_index", "hook_point_head_index")):
        raise ValueError(f"{path}: SAEs on one head (hook_head_index) are not supported")
    architecture = raw.get("architecture", "standard")
    transcoder = {name: key for key, name in TRANSCODER_NAMES.items()}.get(architecture)
    hook_name_out = raw.get("hook_name_out") or meta.get("hook_name_out")
    if transcoder is None and (hook_name_out is not None or raw.get("d_out") is not None):
        raise ValueError(f"{path} names hook_name_out/d_out but architecture {architecture!r}: a transcoder's file says "
                         f"one of {', '.join(TRANSCODER_NAMES.values())}")
    if transcoder is not None:
        if hook_name_out is None:
            raise ValueError(f"{path} is a transcoder ({architecture}) but names no hook_name_out: which activation it "
                             "predicts is unknown; add \"hook_name_out\" to its cfg.json")
        architecture = transcoder[0]
    normalize = raw.get("normalize_activations") or "none"
    # SAELens's load_from_disk runs "expected_average_only_in" files as they are (from_pretrained folds the scale into
    # the weights on download, and saves it so): the same as "none"
    if normalize not in ("none", "expected_average_only_in"):
        raise ValueError(f"{path}: normalize_activations={normalize!r} is not supported (only 'none', and "
                         "'expected_average_only_in', which SAELens's load_from_disk also runs as it is)")
    if raw.get("rescale_acts_by_decoder_norm"):
        raise ValueError(f"{path}: rescale_acts_by_decoder_norm=true is not supported")
    kwargs = raw.get("activation_fn_kwargs") or {}
    activation = raw.get("activation_fn_str") or raw.get("activation_fn") or "relu"
    if activation == "topk":  # SAELens 3-5 spelled topk so
        architecture = "topk"
    elif activation != "relu":
        raise ValueError(f"{path}: activation {activation!r} is not supported; supported: relu (standard, jumprelu), topk")
    try:
        return SAEConfig(d_in=raw["d_in"], d_sae=raw["d_sae"], hook_name=hook_name, architecture=architecture,
                         k=raw.get("k", kwargs.get("k")) if architecture == "topk" else None,
                         apply_b_dec_to_input=bool(raw.get("apply_b_dec_to_input", transcoder is None)),  # a bool or null, checked above
                         model_name=raw.get("model_name") or meta.get("model_name"),
                         hook_name_out=hook_name_out if transcoder else None,
                         d_out=raw["d_out"] if transcoder else None, skip=bool(transcoder and transcoder[1]),
                         file_metadata=tuple((k, v) for k, v in meta.items()
                                             if k not in ("model_name", "hook_name", "hook_name_out")))
    except KeyError as err:
        raise ValueError(f"{path} lacks the field {err.args[0]!r}") from None
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
