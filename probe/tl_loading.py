"""transformer-lens's `from_pretrained` keywords on HookedDecoder.from_pretrained, so TL's loading line runs unchanged.

probe loads a checkpoint's own weights. Code that passes any of TL's processing keywords (`fold_ln=`,
`center_writing_weights=`, `center_unembed=`, `fold_value_biases=`, `refactor_factored_attn_matrices=`) gets TL's
processing instead: the keywords it gives, and TL's defaults for the ones it leaves out, as
`HookedTransformer.from_pretrained` would (a fold or centring that does not apply to the model, such as centring the
writers of an RMSNorm model, is skipped with a warning, by default or asked for, as TL skips it; a refactoring that
cannot be done is refused with the reason, as TL refuses it).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

from probe.checkpoint_tl import is_tl_format, load_tl_format
from probe.config_file import read_json_object
from probe.loading import SHORT_NAMES, load_hf_model, load_pretrained, load_tokenizer, resolve_checkpoint
from probe.processing import TL_PROCESSING_DEFAULTS, process_weights_in_place, tl_processing_steps
from probe.tl_surface import refuse_unsupported
from probe.tokenizer import Tokenizer

NO_PROCESSING = {step: False for step in TL_PROCESSING_DEFAULTS}  # from_pretrained_no_processing's
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
               "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64}
LOADING_HINTS = {
    "checkpoint_index": "pass checkpoint_value=<step> or revision='step<N>' (the index needs the hub's list of "
                        "checkpoints; Pythia's training checkpoints are hub revisions)",
    "n_devices": "pass device_map='auto' (or {layer: device}) to spread the blocks over several devices",
    "first_n_layers": "load the whole model and run it with stop_at_layer=",
}


@dataclasses.dataclass(frozen=True)
class LoadingKeywords:
    """What transformer-lens's loading keywords ask of a load."""

    dtype: Optional[torch.dtype]
    device: Optional[Union[str, torch.device]]
    revision: Optional[str]
    hf_model: Any  # a transformers model in memory, to load instead of the name's weights
    tokenizer: Optional[Tokenizer]  # a transformers tokenizer's, in place of the checkpoint's
    processing: Optional[dict[str, bool]]  # None: the checkpoint's own weights
    default_prepend_bos: Optional[bool]
    default_padding_side: Optional[str]
    checkpoint: Optional[tuple[int, int]] = None  # checkpoint_value=: (the step, its index among TL's list of them)

    @property
    def load_dtype(self) -> Optional[torch.dtype]:
        """Processed weights are computed in float32 and cast afterwards, so half precision rounds only once."""
        if self.processing and self.dtype in (torch.float16, torch.bfloat16):
            return torch.float32
        return self.dtype


def parse_loading_keywords(name_or_path, dtype: Any, device: Any, revision: Optional[str],
                           keywords: dict[str, Any], caller: str = "HookedDecoder") -> LoadingKeywords:
    """Read TL's keywords out of `keywords` (from_pretrained's **kwargs); a TypeError for any probe does not take,
    naming the class it was called on (`caller`)."""
    keywords = dict(keywords)
    checkpoint = None
    if "checkpoint_value" in keywords:
        if revision is not None:
            raise TypeError("pass revision= or checkpoint_value=, not both")
        step = keywords.pop("checkpoint_value")
        revision = checkpoint_revision(name_or_path, step)
        checkpoint = (step, checkpoint_steps(name_or_path).index(step))
    if "torch_dtype" in keywords:  # TL's older spelling of dtype
        if dtype is not None:
            raise TypeError("pass dtype= or torch_dtype=, not both")
        dtype = keywords.pop("torch_dtype")
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype={dtype!r} is not a dtype name; use one of {', '.join(DTYPE_NAMES)} or a torch.dtype")
        dtype = DTYPE_NAMES[dtype]
    if keywords.pop("n_devices", 1) != 1:
        raise TypeError(f"from_pretrained does not take n_devices= above 1: {LOADING_HINTS['n_devices']}")
    given = {step: keywords.pop(step) for step in TL_PROCESSING_DEFAULTS if step in keywords}
    prepend_bos = keywords.pop("default_prepend_bos", None)
    move_to_device = keywords.pop("move_to_device", True)
    for name, value in {**given, "default_prepend_bos": prepend_bos, "move_to_device": move_to_device}.items():
        if value is not None and not isinstance(value, bool):  # "no" would read as True
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if not move_to_device:
        device = "cpu"  # TL leaves the weights where they were built
    padding_side = keywords.pop("default_padding_side", None)
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"default_padding_side={padding_side!r} must be 'left' or 'right'")
    hf_model, tokenizer = keywords.pop("hf_model", None), keywords.pop("tokenizer", None)
    refuse_unsupported(keywords, f"{caller}.from_pretrained()", LOADING_HINTS)
    return LoadingKeywords(dtype=dtype, device=device, revision=revision, hf_model=hf_model,
                           tokenizer=None if tokenizer is None else Tokenizer.from_transformers(tokenizer),
                           processing=given or None,
                           default_prepend_bos=prepend_bos, default_padding_side=padding_side, checkpoint=checkpoint)


def checkpoint_revision(name_or_path, step) -> str:
    """The hub revision of TL's `checkpoint_value=step`: Pythia's branches are `step<N>`, Stanford CRFM's GPT-2 runs'
    `checkpoint-<N>`."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise TypeError(f"checkpoint_value must be a training step (an int), got {step!r}")
    steps = checkpoint_steps(name_or_path)
    if step not in steps:
        later = [s for s in steps if s > step]
        raise ValueError(f"{name_or_path!r} has no checkpoint at step {step}; the nearest are "
                         f"{max((s for s in steps if s < step), default=None)} and {later[0] if later else None}")
    repo = SHORT_NAMES.get(str(name_or_path), str(name_or_path))
    return f"step{step}" if repo.startswith("EleutherAI/pythia-") else f"checkpoint-{step}"


def checkpoint_steps(name_or_path) -> list[int]:
    """The training steps saved for a Pythia model or a Stanford CRFM GPT-2 run, as transformer-lens lists them (its
    checkpoint_index counts along this list)."""
    repo = SHORT_NAMES.get(str(name_or_path), str(name_or_path))
    if repo.startswith("EleutherAI/pythia-"):
        later = list(range(1000, 143000 + 1, 1000))
        return later if "v0" in repo else [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512] + later  # v0: no early steps
    if repo.startswith("stanford-crfm/"):
        return (list(range(0, 100, 10)) + list(range(100, 2000, 50)) + list(range(2000, 20000, 100))
                + list(range(20000, 400000 + 1, 1000)))
    raise TypeError(f"checkpoint_value= picks a training checkpoint of Pythia or Stanford CRFM's GPT-2 runs, and "
                    f"{name_or_path!r} is neither; pass revision= (a hub branch, tag or commit) instead")


def load_model(name_or_path, options: LoadingKeywords, model_class: type):
    """The checkpoint `name_or_path` names, or `hf_model` with the name's tokenizer (TL's `hf_model=`: nothing but
    the tokenizer is read for the name); `tokenizer=` replaces the tokenizer either way."""
    if options.hf_model is None:
        directory = resolve_checkpoint(name_or_path, options.revision)
        config = read_json_object(directory / "config.json")
        if is_tl_format(config):  # transformer-lens's own format (Neel Nanda's toy models): TL config, *final.pth
            model = load_tl_format(directory, config, load_tokenizer, options.device, options.load_dtype, model_class,
                                   source=SHORT_NAMES.get(str(name_or_path), str(name_or_path)))
        else:
            model = load_pretrained(directory, device=options.device, dtype=options.load_dtype, model_class=model_class)
        if options.tokenizer is not None:
            model.set_tokenizer(options.tokenizer)
        return model
    tokenizer = options.tokenizer if options.tokenizer is not None else load_tokenizer(name_or_path, options.revision)
    return load_hf_model(options.hf_model, tokenizer, options.device, options.load_dtype, model_class=model_class)


def finish_loading(model, options: LoadingKeywords):
    """Apply the processing and defaults `options` ask for to a freshly loaded model (nothing else holds it)."""
    if options.processing is not None:
        process_weights_in_place(model, **tl_processing_steps(model.cfg, options.processing, "from_pretrained",
                                                              loading=True))
        if options.load_dtype != options.dtype:
            model.to(options.dtype)
    if options.default_prepend_bos is not None:
        model.cfg = dataclasses.replace(model.cfg, default_prepend_bos=bool(options.default_prepend_bos))
    if options.checkpoint is not None:
        step, index = options.checkpoint
        model.cfg = dataclasses.replace(model.cfg, checkpoint_value=step, checkpoint_index=index)
    if options.default_padding_side is not None:
        if model.tokenizer is None:
            raise ValueError("default_padding_side= needs a tokenizer, and this checkpoint has none")
        model.tokenizer.padding_side = options.default_padding_side
    return model
