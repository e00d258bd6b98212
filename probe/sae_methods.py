"""SAELens's HookedSAETransformer methods on HookedDecoder, so SAE code written for it runs unchanged:
`run_with_saes`, `run_with_cache_with_saes`, `run_with_hooks_with_saes` and the `saes()` block splice SAEs in for
one call; `add_sae` keeps one spliced in until `reset_saes()` (visible in `acts_to_saes`). A face over
probe.sae.spliced and probe.sae.attach. They take SAELens's own SAE objects too, as probe's copies of them: what
`acts_to_saes` holds, and what a later change to the SAELens object does not reach."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple, Optional, Sequence, Union

from torch.nn import Module

from probe.sae import SparseAutoencoder, attach, spliced

SAEs = Union[SparseAutoencoder, Sequence[SparseAutoencoder]]


class Attached(NamedTuple):
    sae: SparseAutoencoder
    use_error_term: Optional[bool]
    detach: Callable[[], None]


def as_probes(saes) -> list[SparseAutoencoder]:
    """One SAE or several, each probe's own or SAELens's (`sae_lens.SAE` objects, which SAELens code passes to
    HookedSAETransformer's methods): SAELens's become probe's copies, read when they are passed."""
    def ours(sae) -> SparseAutoencoder:
        if isinstance(sae, SparseAutoencoder):
            return sae
        if type(sae).__module__.split(".")[0] == "sae_lens":
            return SparseAutoencoder.from_saelens(sae)
        raise TypeError(f"expected probe's SparseAutoencoder or an SAE of SAELens, got {type(sae).__name__}")

    return [ours(sae) for sae in ([saes] if isinstance(saes, Module) else saes)]


def _refuse_exclusion(exclude_special_tokens) -> None:
    if exclude_special_tokens is not False:
        raise ValueError("exclude_special_tokens is not supported: the SAE runs at every position; to keep the model's "
                         "own activation at some positions, hook `<hook_name>.hook_sae_output` and put them back")


class SAEMethods:
    """Mixed into HookedDecoder (see the module docstring)."""

    def _sae_attachments(self) -> dict[str, Attached]:
        return self.__dict__.setdefault("_attached_saes", {})  # beside nn.Module's registries, not in them

    def __getstate__(self) -> dict:
        state = super().__getstate__()  # a copy (deepcopy, process_weights) has none of the original's hooks,
        state.pop("_attached_saes", None)  # so none of its SAEs either
        return state

    @property
    def acts_to_saes(self) -> dict:
        """{hook name: SAE} for the SAEs `add_sae` attached; or the dict assigned to it, by a subclass that keeps its
        own (transformer-lens's pre-SAELens HookedSAETransformer sets `self.acts_to_saes = {}` and splices SAE
        modules into the tree itself: see `setup()`)."""
        own = self.__dict__.get("_own_acts_to_saes")
        if own is not None:
            return own
        return {name: attached.sae for name, attached in self._sae_attachments().items()}

    @acts_to_saes.setter
    def acts_to_saes(self, value: dict) -> None:
        if not isinstance(value, dict):
            raise TypeError(f"acts_to_saes takes a dict of hook name -> SAE, got {type(value).__name__}")
        self.__dict__["_own_acts_to_saes"] = value

    def add_sae(self, sae: SparseAutoencoder, use_error_term: Optional[bool] = None,
                exclude_special_tokens=False) -> None:
        """Splice `sae` in until `reset_saes()`, replacing one attached at the same hook point (as SAELens does).
        `use_error_term=None`: the SAE's own `sae.use_error_term`."""
        _refuse_exclusion(exclude_special_tokens)
        [sae] = as_probes(sae)
        attached = self._sae_attachments()
        if sae.cfg.hook_name in attached:
            self.reset_saes(sae.cfg.hook_name)
        attached[sae.cfg.hook_name] = Attached(sae, use_error_term, attach(self, sae, use_error_term))

    def reset_hooks(self, clear_contexts: bool = True, direction: str = "both", including_permanent: bool = False,
                    level=None) -> None:
        """The hooks' reset; attached SAEs stay attached, as SAELens's do (they are modules there, not hooks):
        `reset_saes()` removes them."""
        super().reset_hooks(clear_contexts, direction, including_permanent, level)
        if not including_permanent:  # the splices' hooks are permanent ones: still there
            return
        attached = self._sae_attachments()
        for name, previous in list(attached.items()):  # their hooks have just gone: splice them anew
            previous.detach()
            attached[name] = Attached(previous.sae, previous.use_error_term,
                                      attach(self, previous.sae, previous.use_error_term))

    def reset_saes(self, act_names: Optional[Union[str, Sequence[str]]] = None) -> None:
        """Detach the SAEs `add_sae` attached at these hook names (all of them by default)."""
        attached = self._sae_attachments()
        names = list(attached) if act_names is None else [act_names] if isinstance(act_names, str) else list(act_names)
        missing = [name for name in names if name not in attached]
        if missing:
            raise ValueError(f"no SAE is attached at {', '.join(missing)}; attached: {', '.join(attached) or 'none'}")
        for name in names:
            attached.pop(name).detach()

    @contextmanager
    def saes(self, saes: SAEs = (), reset_saes_end: bool = True, use_error_term: Optional[bool] = None,
             exclude_special_tokens=False) -> Iterator["SAEMethods"]:
        """`saes` spliced in for the block; an SAE attached at the same hook point steps aside and comes back after.
        `reset_saes_end=False` leaves them attached, as `add_sae` does."""
        _refuse_exclusion(exclude_special_tokens)
        saes = as_probes(saes)
        if not reset_saes_end:
            for sae in saes:
                self.add_sae(sae, use_error_term)
            yield self
            return
        attached = self._sae_attachments()
        displaced = [attached[sae.cfg.hook_name] for sae in saes if sae.cfg.hook_name in attached]
        for previous in displaced:
            self.reset_saes(previous.sae.cfg.hook_name)
        try:
            with spliced(self, saes, use_error_term):
                yield self
        finally:
            for previous in displaced:
                self.add_sae(previous.sae, previous.use_error_term)

    def run_with_saes(self, *model_args, saes: SAEs = (), reset_saes_end: bool = True,
                      use_error_term: Optional[bool] = None, exclude_special_tokens=False, **model_kwargs):
        """The forward with `saes` spliced in."""
        with self.saes(saes, reset_saes_end, use_error_term, exclude_special_tokens):
            return self(*model_args, **model_kwargs)

    def run_with_cache_with_saes(self, *model_args, saes: SAEs = (), reset_saes_end: bool = True,
                                 use_error_term: Optional[bool] = None, exclude_special_tokens=False,
                                 return_cache_object: bool = True, remove_batch_dim: bool = False, **kwargs):
        """`run_with_cache` with `saes` spliced in: the cache holds `<hook_name>.hook_sae_acts_post` and the rest."""
        with self.saes(saes, reset_saes_end, use_error_term, exclude_special_tokens):
            return self.run_with_cache(*model_args, return_cache_object=return_cache_object,
                                       remove_batch_dim=remove_batch_dim, **kwargs)

    def run_with_hooks_with_saes(self, *model_args, saes: SAEs = (), reset_saes_end: bool = True,
                                 exclude_special_tokens=False, fwd_hooks=(), bwd_hooks=(), reset_hooks_end: bool = True,
                                 clear_contexts: bool = False, **model_kwargs):
        """`run_with_hooks` with `saes` spliced in; hooks may name the SAEs' points."""
        with self.saes(saes, reset_saes_end, exclude_special_tokens=exclude_special_tokens):
            return self.run_with_hooks(*model_args, fwd_hooks=fwd_hooks, bwd_hooks=bwd_hooks,
                                       reset_hooks_end=reset_hooks_end, clear_contexts=clear_contexts, **model_kwargs)
