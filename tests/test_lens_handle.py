"""What transformer-lens code reads off a hook's handle (hooks/lens_handle.py): ACDC checks which functions a point
carries through `hook_point.fwd_hooks[i].hook.hooks_dict_ref()`, the module hooks TL registers for them, named after
each function. The oracle: HookedTransformer (transformer-lens 3.9) running the same reads
(tests/saelens_oracle.py's lens_handle_idioms)."""
from __future__ import annotations

import json

import torch

from probe import HookedDecoder
from saelens_oracle import lens_handle_idioms
from test_sae_training import needs_saelens, oracle

CONFIG = dict(n_layers=2, d_model=32, d_head=8, n_ctx=16, d_vocab=50, act_fn="gelu")


@needs_saelens
def test_a_points_handles_read_as_transformer_lens_handles_read():
    theirs = json.loads(oracle("lens_handles", json.dumps(CONFIG)))
    assert lens_handle_idioms(HookedDecoder(dict(CONFIG))) == theirs
    assert theirs["names"][0].startswith("partial(<function lens_handle_idioms.<locals>.sender_hook")


def test_a_module_hook_runs_its_function_on_the_output_as_torch_would_call_it():
    model = HookedDecoder(dict(CONFIG))
    seen = []
    handle = model.hook_dict["blocks.1.hook_resid_post"].add_hook(lambda x, hook: seen.append(hook.name) or x * 2)
    module_hook, = handle.hook.hooks_dict_ref().values()
    point = model.hook_dict["blocks.1.hook_resid_post"]
    x = torch.ones(1, 2, 32)
    assert torch.equal(module_hook(point, (x,), x), x * 2) and seen == ["blocks.1.hook_resid_post"]
    assert module_hook is handle.module_hook  # the same wrapper each read, as torch's dict holds one
