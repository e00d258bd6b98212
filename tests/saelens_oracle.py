"""Run by the SAELens virtualenv's Python (scripts/saelens_oracle.sh): SAELens 6 needs transformer-lens < 4, which
the main environment cannot have. Reads and writes safetensors only. The tests import two functions from it,
`hooked_sae_idioms` and `lens_handle_idioms`, to run the same idioms on probe; everything that imports SAELens stays inside the commands.

    python saelens_oracle.py serve
        runs the commands below sent on stdin, one process for them all (tests/oracle_process.py is its client)
    python saelens_oracle.py encode SAE_DIR INPUTS OUTPUTS
        SAE.load_from_disk(SAE_DIR); INPUTS holds x; OUTPUTS gets features, output (SAELens's forward)
    python saelens_oracle.py schedules STEPS
        SAELens's learning-rate and coefficient schedules over STEPS steps (see the function): stdout their JSON
    python saelens_oracle.py fold SAE_DIR INPUTS OUTPUTS
        the SAE after its fold_W_dec_norm(): OUTPUTS gets features, output and its W_enc, W_dec, b_enc (threshold)
    python saelens_oracle.py hooked_sae MODEL_DIR SAE_DIR INPUTS OUTPUTS
        HookedSAETransformer (transformer-lens 3's HookedTransformer, built offline from a GPT-2 directory's
        weights, unprocessed) runs hooked_sae_idioms with the SAE in SAE_DIR on INPUTS' tokens; OUTPUTS gets each
        idiom's results by name
    python saelens_oracle.py probe_with_saelens_sae MODEL_DIR SAE_DIR INPUTS OUTPUTS
        the same idioms on probe (imported from this repository) with SAELens's own SAE object for SAE_DIR: what
        SAELens code does when only the model's loading line changes
    python saelens_oracle.py tl_state_dict KIND MODEL_DIR CONFIG_JSON STATE INPUTS OUTPUTS
        transformer-lens 3's HookedTransformer(HookedTransformerConfig(**CONFIG)) for the transformers checkpoint
        in MODEL_DIR (KIND: gpt2, llama, neox, qwen3 or gemma: TL's converter for it). OUTPUTS gets tl.KEY, TL's
        own state dict of that checkpoint (its converter's, unprocessed), tl_logits (TL's forward with them) and
        logits (TL's forward after load_state_dict(STATE, strict=False)) on INPUTS' tokens; stdout the JSON of a
        fresh model's state-dict shapes and that load's missing and unexpected keys
    python saelens_oracle.py tl_build CONFIG_JSON INPUTS OUTPUTS [PROCESS_JSON]
        HookedTransformer(HookedTransformerConfig(**CONFIG)), its weights then moved off their initialisation
        (seeded; a gated MLP's b_in stays zero): OUTPUTS gets state.KEY (its state dict) and logits on INPUTS'
        tokens; stdout the JSON of the config's resolved values (n_heads, d_mlp, initializer_range, ...). With
        PROCESS_JSON, the model then load_and_process_state_dict(state, **PROCESS): OUTPUTS also gets processed.KEY
        and processed_logits, and the JSON processed_normalization_type
    python saelens_oracle.py toy_idioms CONFIG_JSON STATE INPUTS OUTPUTS
        HookedTransformer(HookedTransformerConfig(**CONFIG)) with the state dict STATE runs toy_idioms on INPUTS'
        tokens; OUTPUTS gets each idiom's result by name
    python saelens_oracle.py state_steps CONFIG_JSON STATE INPUTS OUTPUTS STEPS_JSON FOLD_JSON
        a fresh HookedTransformer(HookedTransformerConfig(**CONFIG)) runs tests/state_processing_idioms.py on the
        state dict STATE (the steps STEPS, fold_layer_norm with the keywords FOLD) and INPUTS' tokens; OUTPUTS gets
        each result by name
    python saelens_oracle.py attention_buffers CONFIG_JSON OUTPUTS
        HookedTransformer(HookedTransformerConfig(**CONFIG))'s attention buffers (see the function)
    python saelens_oracle.py sae_splice MODEL_DIR INPUTS OUTPUTS
        a subclass of HookedTransformer (tests/sae_splice_idioms.py) with a GPT-2 directory's weights, unprocessed,
        runs sae_splice_idioms, then wrapper_idioms, on INPUTS' tokens: OUTPUTS gets each result by name; stdout the JSON of its listings
    python saelens_oracle.py auto_circuit_scores SIDE WORK_DIR OUTPUTS
        auto_circuit 1.0.1's scores and circuits on a small random model (see the function): SIDE tl writes the
        model's weights and prompts to WORK_DIR, SIDE probe reads them and runs with probe's classes
    python saelens_oracle.py config_class CONFIG_JSON
        stdout: the JSON of tests/config_class_idioms.py run on HookedTransformer(HookedTransformerConfig(**CONFIG))
    python saelens_oracle.py patch_wrappers MODEL_DIR INPUTS OUTPUTS
        HookedTransformer with a GPT-2 directory's weights, unprocessed, runs tests/patch_wrapper_idioms.py on INPUTS'
        tokens: OUTPUTS gets each result by name; stdout the JSON of each wrapper's calls
    python saelens_oracle.py induction CONFIG_JSON STATE INPUTS SEQ_LEN OUTPUTS
        HookedTransformer(HookedTransformerConfig(**CONFIG)) with the state dict STATE runs
        tests/induction_idioms.py's induction_idioms on INPUTS' tokens; OUTPUTS gets each result by name
    python saelens_oracle.py brackets STATE OUTPUTS
        HookedTransformer(HookedTransformerConfig(**brackets_idioms.CONFIG)) with the state dict STATE runs
        tests/brackets_idioms.py's brackets_idioms; OUTPUTS gets each result by name
    python saelens_oracle.py neel NAME DIR INPUTS OUTPUTS PROCESS_JSON
        transformer-lens 3's own from_pretrained(NAME, **PROCESS) for one of Neel Nanda's toy models, its hub reads
        served from DIR (a TL-format config.json; a model_final.pth is first written there, a HookedTransformer of
        that config with its weights moved off their initialisation, if DIR has none): OUTPUTS gets logits on
        INPUTS' tokens and state.KEY (the loaded, processed state dict); stdout the JSON of its cfg's values
    python saelens_oracle.py circuits CASES_JSON INPUTS OUTPUTS
        for each case NAME of CASES ({NAME: {"config": ..., "spec": ...}}, one process for them all: its start
        costs more than a case), HookedTransformer(HookedTransformerConfig(**config)), its weights moved off their
        initialisation, runs tests/circuits_by_hand.py on INPUTS' NAME/clean and NAME/corrupted tokens with the
        spec (answers, wrongs, paths, circuits); OUTPUTS gets NAME/state.KEY and NAME/ each result by name
    python saelens_oracle.py tl_cache CONFIG_JSON INPUTS OUTPUTS [PROCESS_JSON]
        HookedTransformer(HookedTransformerConfig(**CONFIG)), its weights moved off their initialisation (seeded, every
        parameter): OUTPUTS gets state.KEY, logits and cache.NAME (every hook run_with_cache caches) on INPUTS'
        tokens; stdout the JSON of its n_params. With PROCESS_JSON, the model then load_and_process_state_dict(state,
        **PROCESS): OUTPUTS also gets processed.KEY, processed_logits and processed_cache.NAME
    python saelens_oracle.py tl_caches CASES_JSON INPUTS OUTPUTS
        tl_cache for each case NAME of CASES ({NAME: {"config": ..., "process": PROCESS or null}}) in one process:
        OUTPUTS gets NAME/ each key; stdout the JSON {NAME: n_params}
    python saelens_oracle.py tl_config_cases CASES_JSON INPUTS OUTPUTS
        for each case NAME of CASES ({NAME: {"config": ..., "generate": [KEYWORDS, ...]}}, one process for them all),
        HookedTransformer(HookedTransformerConfig(**config)) (its tokenizer_name's tokenizer loaded, as TL loads it),
        its weights moved off their initialisation as tl_build moves them: OUTPUTS gets NAME/state.KEY, NAME/logits on
        INPUTS' tokens and NAME/generate.I, the model's greedy generate(PROMPT, **KEYWORDS) for each KEYWORDS (PROMPT:
        model.embed(tokens), or with "from": "tokens" the token ids), and gelu_fast, TL's gelu_fast(INPUTS' x); stdout
        the JSON {"fields": HookedTransformerConfig's field names, NAME: {field: the model's cfg value (a dtype as
        its name)}, "text": {NAME/generate.I: a str output}}
    python saelens_oracle.py padding MODEL_DIR INPUTS OUTPUTS
        transformer-lens 3's HookedTransformer for a GPT-2 directory (unprocessed, its tokenizer set by set_tokenizer)
        runs padding_cases on INPUTS' padded token ids (left, left_nobos, left_pad1, right): OUTPUTS gets each case's
        logits, last-position resid (the last block's resid_post), loss and last-position logits with a hook; stdout
        the JSON of return_type="both"'s type name and fields and generate(..., return_type="str") of one row of
        ids, two rows, and a list of one string
    python saelens_oracle.py ungrouped CASES_JSON INPUTS OUTPUTS
        for each case NAME of CASES ({NAME: config}), HookedTransformer(HookedTransformerConfig(**config)), its weights
        moved off their initialisation as tl_build moves them, runs tests/ungrouped_idioms.py on INPUTS' tokens:
        OUTPUTS gets NAME/state.KEY and NAME/ each result by name
    python saelens_oracle.py kv_cache_loop CONFIG_JSON STATE INPUTS OUTPUTS TOKENIZER_DIR
        HookedTransformer(HookedTransformerConfig(**CONFIG), tokenizer=TOKENIZER_DIR's) with the state dict STATE runs
        tests/kv_cache_idioms.py
        with transformer-lens 3.9's TransformerLensKeyValueCache on INPUTS' tokens; OUTPUTS gets each result by name
    python saelens_oracle.py sae_surface WORK_DIR INPUTS OUTPUTS
        SAELens writes a standard SAE on blocks.1.attn.hook_z (metadata with hook_layer, prepend_bos, context_size) and
        a TopK SAE into WORK_DIR/z and WORK_DIR/topk (SAE.save_model), then runs tests/sae_surface_idioms.py with its
        SAE class on INPUTS' z: OUTPUTS gets the tensors by name; stdout the JSON of the plain values
    python saelens_oracle.py saelens_tools MODEL_DIR SAE_DIR OUTPUTS
        SAELens's own tools given probe's SparseAutoencoder and given SAELens's SAE, both loaded from SAE_DIR, on
        probe's model of MODEL_DIR (probe imported from this repository): ActivationsStore.from_sae's token batch and
        activations, and run_evals' metrics under one seed; OUTPUTS gets {CLASS}/activations; stdout the JSON of
        {CLASS: {"tokens": ..., "metrics": ...}}
    python saelens_oracle.py loss ARCH SETTINGS_JSON STATE INPUTS OUTPUTS
        a SAELens training SAE of ARCH with the settings, the weights in STATE; INPUTS holds x and dead_mask;
        OUTPUTS gets each loss term, and the gradient of the total loss to every parameter (grad.NAME)
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file


def encode(sae_dir: str, inputs: str, outputs: str) -> None:
    from sae_lens import SAE

    sae = SAE.load_from_disk(sae_dir, device="cpu")
    x = load_file(inputs)["x"]
    with torch.no_grad():
        features = sae.encode(x)
        out = sae(x)
    save_file({"features": features.contiguous(), "output": out.contiguous()}, outputs)
    print(type(sae).__name__)


def loss(arch: str, settings_json: str, state: str, inputs: str, outputs: str) -> None:
    import sae_lens.saes as saes
    from sae_lens.saes.sae import TrainStepInput

    settings = json.loads(settings_json)
    coefficients = settings.pop("coefficients", {})
    classes = {"standard": ("StandardTrainingSAE", "StandardTrainingSAEConfig"),
               "topk": ("TopKTrainingSAE", "TopKTrainingSAEConfig"),
               "batchtopk": ("BatchTopKTrainingSAE", "BatchTopKTrainingSAEConfig"),
               "jumprelu": ("JumpReLUTrainingSAE", "JumpReLUTrainingSAEConfig")}
    model_cls, cfg_cls = (getattr(saes, name) for name in classes[arch])
    sae = model_cls(cfg_cls(dtype="float64", device="cpu", **settings))
    weights = load_file(state)
    sae.load_state_dict({k: v.double() for k, v in weights.items()}, strict=False)
    data = load_file(inputs)
    step = TrainStepInput(sae_in=data["x"].double(), coefficients=coefficients, dead_neuron_mask=data["dead_mask"].bool(),
                          n_training_steps=0, is_logging_step=False)
    result = sae.training_forward_pass(step)
    result.loss.backward()
    written = {name: value.detach().reshape(()).contiguous() for name, value in result.losses.items()}
    written["loss"] = result.loss.detach().contiguous()
    written.update({f"grad.{n}": p.grad.contiguous() for n, p in sae.named_parameters() if p.grad is not None})
    save_file(written, outputs)


def schedules(steps: str) -> None:
    """SAELens's learning-rate schedule (constant, 3 warm-up and 4 decay steps, lr 0.1) and its coefficient's warm-up
    (5 steps to 0.7) over STEPS steps: stdout the JSON {"lr": [...], "coefficient": [...]}."""
    from sae_lens.training.optim import CoefficientScheduler, get_lr_scheduler

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([p], lr=0.1)
    sched = get_lr_scheduler("constant", opt, training_steps=int(steps), lr=0.1, warm_up_steps=3, decay_steps=4,
                             lr_end=0.1, num_cycles=1)
    coef = CoefficientScheduler(warm_up_steps=5, final_value=0.7)
    lrs, coefficients = [], []
    for _ in range(int(steps)):
        lrs.append(opt.param_groups[0]["lr"])
        coefficients.append(coef.value)
        opt.step()
        sched.step()
        coef.step()
    print(json.dumps({"lr": lrs, "coefficient": coefficients}))


def fold(sae_dir: str, inputs: str, outputs: str) -> None:
    from sae_lens import SAE

    sae = SAE.load_from_disk(sae_dir, device="cpu")
    sae.fold_W_dec_norm()
    x = load_file(inputs)["x"]
    with torch.no_grad():
        out = {"features": sae.encode(x), "output": sae(x)}
    out.update({name: p.detach() for name, p in sae.named_parameters() if name in ("W_enc", "W_dec", "b_enc", "threshold")})
    save_file({k: v.clone().contiguous() for k, v in out.items()}, outputs)


def hooked_gpt2(model_dir: str):
    from sae_lens import HookedSAETransformer
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(model_dir)
    c = hf.config
    cfg = HookedTransformerConfig(n_layers=c.n_layer, d_model=c.n_embd, n_ctx=c.n_positions, d_head=c.n_embd // c.n_head,
                                  n_heads=c.n_head, d_mlp=4 * c.n_embd, d_vocab=c.vocab_size, act_fn="gelu_new",
                                  normalization_type="LN", eps=c.layer_norm_epsilon, device="cpu")
    model = HookedSAETransformer(cfg)
    model.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False)
    return model.eval()


def tl_state_dict(kind: str, model_dir: str, config_json: str, state: str, inputs: str, outputs: str) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained import weight_conversions
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    cfg = HookedTransformerConfig(**json.loads(config_json), device="cpu")
    model = HookedTransformer(cfg).eval()
    shapes = {key: list(t.shape) for key, t in model.state_dict().items()}
    converted = getattr(weight_conversions, f"convert_{kind}_weights")(hf, cfg)
    tokens = load_file(inputs)["tokens"]
    out = {f"tl.{key}": t.detach().clone().contiguous() for key, t in converted.items()}
    with torch.no_grad():
        model.load_state_dict(converted, strict=False)
        out["tl_logits"] = model(tokens).contiguous()
        loaded = model.load_state_dict(load_file(state), strict=False)
        out["logits"] = model(tokens).contiguous()
    save_file(out, outputs)
    print(json.dumps({"shapes": shapes, "missing": loaded.missing_keys, "unexpected": loaded.unexpected_keys}))


RESOLVED = ("n_heads", "d_mlp", "d_vocab_out", "initializer_range", "attn_scale", "n_key_value_heads", "act_fn",
            "normalization_type", "positional_embedding_type", "rotary_dim", "eps", "default_prepend_bos",
            "use_attn_result", "parallel_attn_mlp", "gated_mlp", "final_rms", "attn_only", "attention_dir")


def moved_off_initialisation(model, scale: float) -> None:
    """Every parameter plus scale N(0, 1) (seeded), except a gated MLP's b_in: TL adds it after the gate's product,
    where probe has no bias, so it stays zero."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if not (model.cfg.gated_mlp and key.endswith("mlp.b_in")):
                p.add_(scale * torch.randn(p.shape, generator=gen))


def tl_build(config_json: str, inputs: str, outputs: str, process_json: str = "") -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(**json.loads(config_json), device="cpu")
    model = HookedTransformer(cfg).eval()
    moved_off_initialisation(model, 0.1)
    with torch.no_grad():
        out = {f"state.{key}": t.detach().clone().contiguous() for key, t in model.state_dict().items()}
        tokens = load_file(inputs)["tokens"]
        out["logits"] = model(tokens).contiguous()
    resolved = {name: getattr(cfg, name) for name in RESOLVED}
    if process_json:
        model.load_and_process_state_dict({k.removeprefix("state."): v for k, v in out.items()}, **json.loads(process_json))
        with torch.no_grad():
            out.update({f"processed.{key}": t.detach().clone().contiguous() for key, t in model.state_dict().items()})
            out["processed_logits"] = model(tokens).contiguous()
        resolved["processed_normalization_type"] = model.cfg.normalization_type
    save_file(out, outputs)
    print(json.dumps(resolved))


def weight_grads(config_json: str, inputs: str, outputs: str) -> None:
    """HookedTransformer's weights (moved off their initialisation) and, after loss.backward() on `inputs`' tokens,
    the .grad of every weight TL code reads by name."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    model = HookedTransformer(HookedTransformerConfig(**json.loads(config_json), device="cpu")).eval()
    moved_off_initialisation(model, 0.1)
    out = {f"state.{key}": t.detach().clone().contiguous() for key, t in model.state_dict().items()}
    model(load_file(inputs)["tokens"], return_type="loss").backward()
    out.update({f"grad.{key}": p.grad.clone().contiguous() for key, p in model.named_parameters() if p.grad is not None})
    save_file(out, outputs)


def circuits(cases_json: str, inputs: str, outputs: str) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from circuits_by_hand import circuits_by_hand  # beside this file: its folder is on sys.path

    data, out = load_file(inputs), {}
    for name, case in json.loads(cases_json).items():
        model = HookedTransformer(HookedTransformerConfig(**case["config"], device="cpu")).eval()
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen))  # sharper attention than the initialisation's
        results = {f"state.{key}": t for key, t in model.state_dict().items()}
        results.update(circuits_by_hand(model, data[f"{name}/clean"], data[f"{name}/corrupted"], case["spec"]))
        out.update({f"{name}/{key}": t.detach().clone().contiguous() for key, t in results.items()})
    save_file(out, outputs)


def tl_cache(config_json: str, inputs: str, outputs: str, process_json: str = "") -> None:
    out, n_params = _tl_cache(json.loads(config_json), load_file(inputs)["tokens"],
                              json.loads(process_json) if process_json else None)
    save_file(out, outputs)
    print(json.dumps({"n_params": n_params}))


def tl_caches(cases_json: str, inputs: str, outputs: str) -> None:
    """tl_cache for several cases in one process: NAME/KEY for each case's keys; stdout {NAME: n_params}."""
    tokens, out, printed = load_file(inputs)["tokens"], {}, {}
    for name, case in json.loads(cases_json).items():
        results, printed[name] = _tl_cache(case["config"], tokens, case.get("process"))
        out.update({f"{name}/{key}": t for key, t in results.items()})
    save_file(out, outputs)
    print(json.dumps(printed))


def _tl_cache(config: dict, tokens, process) -> tuple[dict, int]:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    cfg = HookedTransformerConfig(**config, device="cpu")
    model = HookedTransformer(cfg).eval()
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for key, p in model.named_parameters():
            if not (cfg.gated_mlp and key.endswith("mlp.b_in")):  # (TL's bias after the gate's product: see above)
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        out = {f"state.{key}": t.detach().clone().contiguous() for key, t in model.state_dict().items()}
        logits, cache = model.run_with_cache(tokens)
        out["logits"] = logits.contiguous()
        out.update({f"cache.{name}": t.clone().contiguous() for name, t in cache.items()})
    if process:
        model.load_and_process_state_dict({k.removeprefix("state."): v for k, v in out.items() if k.startswith("state.")},
                                          **process)
        with torch.no_grad():
            out.update({f"processed.{key}": t.detach().clone().contiguous() for key, t in model.state_dict().items()})
            logits, cache = model.run_with_cache(tokens)
            out["processed_logits"] = logits.contiguous()
            out.update({f"processed_cache.{name}": t.clone().contiguous() for name, t in cache.items()})
    return out, cfg.n_params


def toy_idioms(model, tokens) -> dict:
    """What analyses of a toy model built from its config write (ARENA's grokking and Othello-GPT sections), once:
    the oracle runs them on HookedTransformer, tests/test_tl_state_dict.py on probe (attribute access only)."""
    out = {}
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens)
        out["logits"] = logits
        out["pattern0"] = cache["pattern", 0]
        out["attn_scores0"] = cache["attn_scores", 0]  # a hidden key's score: TL's IGNORE
        out["post0"] = cache["post", 0]  # the MLP's neurons
        out["resid_post_last"] = cache["resid_post", -1]
        out["scale_final"] = cache["ln_final.hook_scale"] if "ln_final.hook_scale" in cache else torch.ones(1)
        out["neuron_logit_map"] = model.blocks[0].mlp.W_out @ model.W_U  # [d_mlp vocab]
        out["embed_to_neurons"] = model.W_E @ model.blocks[0].mlp.W_in  # [vocab d_mlp]
        if model.cfg.positional_embedding_type == "standard":
            out["W_pos"] = model.W_pos
        out["OV_AB"] = model.OV[0, 1].AB
        out["QK_AB"] = model.QK[0, 2].AB
        out["attn_out_sum"] = sum(cache["attn_out", layer] for layer in range(model.cfg.n_layers))
        stack, labels = cache.decompose_resid(return_labels=True)
        out["decomposed"] = stack
        out["n_components"] = torch.tensor([len(labels)])

        def zero_head(z, hook):
            z[:, :, 1] = 0.0
            return z

        out["ablated_logits"] = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", zero_head)])
        out["loss"] = model(tokens, return_type="loss").reshape(1)
    return out


def toy(config_json: str, state: str, inputs: str, outputs: str) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    model = HookedTransformer(HookedTransformerConfig(**json.loads(config_json), device="cpu")).eval()
    model.load_state_dict(load_file(state), strict=False)
    out = toy_idioms(model, load_file(inputs)["tokens"])
    save_file({k: v.detach().clone().contiguous() for k, v in out.items()}, outputs)


def state_steps(config_json: str, state: str, inputs: str, outputs: str, steps_json: str, fold_json: str) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from state_processing_idioms import state_processing_idioms  # beside this file: its folder is on sys.path

    model = HookedTransformer(HookedTransformerConfig(**json.loads(config_json), device="cpu")).eval()
    out = state_processing_idioms(model, load_file(state), load_file(inputs)["tokens"], json.loads(steps_json),
                                  json.loads(fold_json))
    save_file(out, outputs)


CIRCUIT_TRACER_MODEL = dict(n_layers=2, d_model=64, d_head=16, n_heads=4, n_key_value_heads=2, d_mlp=96, n_ctx=32,
                            d_vocab=4096, act_fn="silu", normalization_type="RMS", positional_embedding_type="rotary",
                            rotary_dim=16, gated_mlp=True, final_rms=True)


def circuit_tracer_graphs(tokenizer_file: str, outputs: str) -> None:
    """circuit-tracer 0.5's attribution graph and a feature intervention for one random Llama-like model (grouped-query,
    rotary, RMSNorm) with random transcoders, on TL's HookedTransformer and on probe's: circuit-tracer's module with
    its `from transformer_lens import HookedTransformer` rebound to probe's, in memory (the import-only route).
    OUTPUTS gets tl/KEY and probe/KEY."""
    import inspect
    import shutil
    import types

    import huggingface_hub.constants
    huggingface_hub.constants.HF_HUB_ENABLE_HF_TRANSFER = False  # circuit-tracer reads it; huggingface_hub 1.0 dropped it
    import circuit_tracer.replacement_model.replacement_model_transformerlens as tl_backend
    from circuit_tracer.attribution.attribute import attribute
    from circuit_tracer.transcoder.activation_functions import JumpReLU
    from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder, TranscoderSet
    from transformer_lens import HookedTransformerConfig
    from transformers import PreTrainedTokenizerFast

    import_probe_from_the_repository()
    source = inspect.getsource(tl_backend)
    line = "from transformer_lens import HookedTransformer, HookedTransformerConfig"
    assert line in source, "circuit-tracer's import line moved: update this oracle"
    probe_backend = types.ModuleType("probe_replacement_model")
    exec(compile(source.replace(line, "from probe import HookedTransformer, HookedTransformerConfig"), tl_backend.__file__,
                 "exec"), probe_backend.__dict__)
    import tempfile

    directory = tempfile.mkdtemp()  # a tokenizer directory: TL's set_tokenizer reloads the tokenizer by its path
    PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, bos_token="<|endoftext|>").save_pretrained(directory)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    weights = {}
    out = {}
    for side, backend in (("tl", tl_backend), ("probe", probe_backend)):
        torch.manual_seed(0)
        model = backend.TransformerLensReplacementModel(HookedTransformerConfig(**CIRCUIT_TRACER_MODEL, device="cpu"))
        if side == "tl":
            moved_off_initialisation(model, 0.1)
            weights = {key: t.detach().clone() for key, t in model.state_dict().items()}
            model.set_tokenizer(tokenizer)
        else:
            model.load_state_dict(weights, strict=True)
            model.set_tokenizer(tokenizer)
        generator = torch.Generator().manual_seed(1)
        transcoders = {}
        for layer in range(CIRCUIT_TRACER_MODEL["n_layers"]):
            transcoder = SingleLayerTranscoder(64, 48, JumpReLU(torch.full((48,), 0.05), 0.1), layer, dtype=torch.float32)
            with torch.no_grad():
                for p in (transcoder.W_enc, transcoder.W_dec):
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
            transcoders[layer] = transcoder
        # what from_config does after building (its own build draws fresh weights, and these load first)
        model._configure_replacement_model(TranscoderSet(transcoders, feature_input_hook="mlp.hook_in",
                                                         feature_output_hook="mlp.hook_out"))
        tokens = torch.tensor([0, 464, 390, 318, 257, 1332, 13, 632, 318])
        graph = attribute(tokens, model, max_n_logits=3, batch_size=16, max_feature_nodes=40)
        logits, activations = model.feature_intervention(tokens[None], [(0, 3, 5, 2.0), (1, 4, 7, 0.0)])
        out.update({f"{side}/adjacency": graph.adjacency_matrix, f"{side}/selected": graph.selected_features,
                    f"{side}/active": graph.active_features, f"{side}/values": graph.activation_values,
                    f"{side}/intervened_logits": logits.detach(),
                    f"{side}/intervened_activations": activations.to_dense() if activations.is_sparse else activations})
    save_file({k: v.detach().clone().contiguous() for k, v in out.items()}, outputs)
    shutil.rmtree(directory)


def attention_buffers(config_json: str, outputs: str) -> None:
    """HookedTransformer(HookedTransformerConfig(**CONFIG))'s attention buffers: OUTPUTS gets L.mask, L.rotary_sin,
    L.rotary_cos per layer; stdout the JSON of the layers' attn_type."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    model = HookedTransformer(HookedTransformerConfig(**json.loads(config_json), device="cpu"))
    save_file({f"{layer}.{name}": getattr(block.attn, name).contiguous() for layer, block in enumerate(model.blocks)
               for name in ("mask", "rotary_sin", "rotary_cos")}, outputs)
    print(json.dumps([block.attn.attn_type for block in model.blocks]))


def sae_splice(model_dir: str, inputs: str, outputs: str) -> None:
    from transformer_lens import HookedTransformer
    from transformer_lens.hook_points import HookedRootModule, HookPoint

    from sae_splice_idioms import sae_splice_idioms, subclass_of, wrapper_idioms  # beside this file: its folder is on sys.path

    plain = hooked_gpt2(model_dir)
    model = subclass_of(HookedTransformer)(plain.cfg).eval()
    model.load_state_dict(plain.state_dict(), strict=True)
    out, names = sae_splice_idioms(model, HookedRootModule, HookPoint, load_file(inputs)["tokens"])
    wrapped, wrapped_names = wrapper_idioms(model, HookPoint, load_file(inputs)["tokens"])
    save_file({**out, **{f"wrapper.{key}": t for key, t in wrapped.items()}}, outputs)
    print(json.dumps({**names, **wrapped_names, "acts_to_saes": sorted(model.acts_to_saes)}))


AUTO_CIRCUIT_MODEL = dict(n_layers=2, d_model=16, d_head=8, n_heads=2, d_mlp=32, n_ctx=32, d_vocab=300, act_fn="gelu_new")


def auto_circuit_scores(side: str, work_dir: str, outputs: str) -> None:
    """auto_circuit 1.0.1's circuit discovery on a small random model: its patchable model (factorized, q/k/v inputs
    apart or one attention input), edge attribution patching, mask gradients (plain and integrated), ACDC, and circuits
    of several sizes with their KL divergence. SIDE "tl" builds the model on HookedTransformer, draws its weights and
    prompts and writes them to WORK_DIR; SIDE "probe" runs the same with transformer_lens.HookedTransformer (and its
    config and key/value cache) rebound to probe's before auto_circuit is imported (the import-only route). auto_circuit
    1.0.1 imports TL 1's `transformer_lens.past_key_value_caching`, which TL 3.9 names otherwise: an alias, both sides."""
    import random
    import sys
    import types
    from pathlib import Path

    import transformer_lens
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache

    model_class, config_class, cache_class = (transformer_lens.HookedTransformer, transformer_lens.HookedTransformerConfig,
                                              TransformerLensKeyValueCache)
    if side == "probe":
        import_probe_from_the_repository()
        import probe

        model_class, config_class, cache_class = (probe.HookedTransformer, probe.HookedTransformerConfig,
                                                  probe.HookedTransformerKeyValueCache)
        transformer_lens.HookedTransformer, transformer_lens.HookedTransformerConfig = model_class, config_class
    caching = types.ModuleType("transformer_lens.past_key_value_caching")
    caching.HookedTransformerKeyValueCache = transformer_lens.HookedTransformerKeyValueCache = cache_class
    sys.modules[caching.__name__] = transformer_lens.past_key_value_caching = caching
    from auto_circuit.data import load_datasets_from_json
    from auto_circuit.metrics.prune_metrics.kl_div import measure_kl_div
    from auto_circuit.prune import run_circuits
    from auto_circuit.prune_algos.ACDC import acdc_prune_scores
    from auto_circuit.prune_algos.edge_attribution_patching import edge_attribution_patching_prune_scores
    from auto_circuit.prune_algos.mask_gradient import mask_gradient_prune_scores
    from auto_circuit.types import PatchType
    from auto_circuit.utils.graph_utils import patchable_model

    work = Path(work_dir)
    model = model_class(config_class(**AUTO_CIRCUIT_MODEL, device="cpu")).eval()
    if side == "tl":
        moved_off_initialisation(model, 0.5)
        save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(work / "state.safetensors"))
        gen = torch.Generator().manual_seed(5)
        clean = torch.randint(1, 300, (8, 7), generator=gen)
        corrupt = clean.clone()
        corrupt[:, 2] = torch.randint(1, 300, (8,), generator=gen)
        answers = torch.randint(1, 300, (8, 2), generator=gen)
        prompts = [{"clean": c.tolist(), "corrupt": k.tolist(), "answers": [int(a[0])], "wrong_answers": [int(a[1])]}
                   for c, k, a in zip(clean, corrupt, answers)]
        (work / "prompts.json").write_text(json.dumps({"prompts": prompts}))
    else:
        model.load_state_dict(load_file(str(work / "state.safetensors")), strict=True)
    model.cfg.use_attn_result = True  # auto_circuit's load_tl_model turns these on
    model.cfg.use_attn_in = True
    model.cfg.use_split_qkv_input = True
    model.cfg.use_hook_mlp_in = True
    for param in model.parameters():
        param.requires_grad = False
    train, test = load_datasets_from_json(None, work / "prompts.json", device=torch.device("cpu"), prepend_bos=False,
                                          batch_size=4, train_test_size=(4, 4), shuffle=False)
    out = {}
    for separate_qkv in (True, False):
        torch.manual_seed(0)
        random.seed(0)
        model.cfg.use_split_qkv_input = separate_qkv  # one attention input: TL's q/k/v inputs would bypass it
        patchable = patchable_model(model, factorized=True, slice_output="last_seq", separate_qkv=separate_qkv,
                                    device=torch.device("cpu"))
        tag = "qkv" if separate_qkv else "attn_in"
        found = {"eap": edge_attribution_patching_prune_scores(patchable, train, None) if separate_qkv else None,
                 "mask_grad": mask_gradient_prune_scores(patchable, train, None, grad_function="logit",
                                                         answer_function="avg_diff", mask_val=0.0),
                 "mask_grad_ig": mask_gradient_prune_scores(patchable, train, None, grad_function="logprob",
                                                            answer_function="avg_val", integrated_grad_samples=3),
                 "acdc": acdc_prune_scores(patchable, train, None, tao_exps=[-2], tao_bases=[1])}
        for method, scores in found.items():
            for module, score in (scores or {}).items():
                out[f"{tag}/{method}/{module}"] = score.detach().float().clone()
        n = len(patchable.edges)
        gen = torch.Generator().manual_seed(1)
        fixed = {module: torch.randn(mask.shape, generator=gen) for module, mask in sorted(patchable.new_prune_scores().items())}
        for patch_type in (PatchType.EDGE_PATCH, PatchType.TREE_PATCH):
            circuits = run_circuits(patchable, test, [0, 3, n // 2, n], fixed, patch_type=patch_type)
            kl = measure_kl_div(patchable, test, circuits)
            out[f"{tag}/kl/{patch_type.name}"] = torch.tensor([value for _, value in kl])
            for size, by_batch in circuits.items():
                out[f"{tag}/circuit/{patch_type.name}/{size}"] = torch.cat([by_batch[key] for key in by_batch]).detach()
        out[f"{tag}/n_edges"] = torch.tensor(n)
    save_file({k: v.contiguous() for k, v in out.items()}, outputs)


def patch_wrappers(model_dir: str, inputs: str, outputs: str) -> None:
    from transformer_lens import HookedTransformer

    from patch_wrapper_idioms import patch_wrapper_idioms  # beside this file: its folder is on sys.path

    plain = hooked_gpt2(model_dir)
    model = HookedTransformer(plain.cfg).eval()
    model.load_state_dict(plain.state_dict(), strict=True)
    out, calls = patch_wrapper_idioms(model, load_file(inputs)["tokens"])
    save_file(out, outputs)
    print(json.dumps(calls))


def induction(config_json: str, state: str, inputs: str, seq_len: str, outputs: str) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from induction_idioms import induction_idioms  # beside this file: its folder is on sys.path

    model = HookedTransformer(HookedTransformerConfig(**json.loads(config_json), device="cpu")).eval()
    model.load_state_dict(load_file(state), strict=True)
    out = induction_idioms(model, load_file(inputs)["tokens"], int(seq_len))
    save_file({k: v.clone().contiguous() for k, v in out.items()}, outputs)


def gpt_oss_demo(model_dir: str, outputs: str) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from gpt_oss_idioms import gpt_oss_demo as run  # beside this file: its folder is on sys.path

    save_file(run(HookedTransformer, HookedTransformerConfig, model_dir), outputs)


def brackets(state: str, outputs: str) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from brackets_idioms import BRACKETS, CONFIG, brackets_idioms  # beside this file: its folder is on sys.path

    model = HookedTransformer(HookedTransformerConfig(**CONFIG, device="cpu")).eval()
    model.load_state_dict(load_file(state), strict=True)
    out = brackets_idioms(model, BRACKETS)
    save_file({k: v.clone().contiguous() for k, v in out.items()}, outputs)


def neel(name: str, directory: str, inputs: str, outputs: str, process_json: str) -> None:
    from pathlib import Path

    import transformer_lens.loading_from_pretrained as loading
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    folder = Path(directory)

    def served(repo, file_name, **_):  # TL's download_file_from_hf: json parsed, .pth torch-loaded
        path = folder / file_name
        return json.loads(path.read_text()) if file_name.endswith(".json") else torch.load(path, weights_only=True)

    class Api:
        def list_repo_files(self, repo, **_):
            return sorted(p.name for p in folder.iterdir())

    loading.utils.download_file_from_hf = served
    loading.HfApi = Api
    official = loading.get_official_model_name(name)
    if not (folder / "model_final.pth").exists():
        cfg = HookedTransformerConfig(**{k: v for k, v in loading.convert_neel_model_config(official).items()
                                         if k != "original_architecture"}, device="cpu")
        fresh = HookedTransformer(cfg)
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in fresh.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        torch.save(fresh.state_dict(), folder / "model_final.pth")
    generator = torch.get_rng_state()
    model = HookedTransformer.from_pretrained(name, device="cpu", **json.loads(process_json)).eval()
    out = {"generator_moved": torch.tensor(not torch.equal(torch.get_rng_state(), generator))}
    with torch.no_grad():
        out["logits"] = model(load_file(inputs)["tokens"]).contiguous()
    out.update({f"state.{k}": v.detach().clone().contiguous() for k, v in model.state_dict().items()})
    save_file(out, outputs)
    print(json.dumps({key: getattr(model.cfg, key) for key in RESOLVED + ("original_architecture",)}))


def hooked_sae_idioms(model, sae, tokens) -> dict:
    """SAELens's HookedSAETransformer idioms, written once: the oracle runs them on HookedSAETransformer, and
    tests/test_sae_methods.py imports this function to run them on probe (only attribute access, no imports)."""
    hook = sae.cfg.metadata.hook_name_out or sae.cfg.metadata.hook_name  # a transcoder's points: where it writes
    out = {}
    with torch.no_grad():
        logits, cache = model.run_with_cache_with_saes(tokens, saes=[sae])
        out["cached.logits"] = logits
        for name in ("hook_sae_input", "hook_sae_acts_pre", "hook_sae_acts_post", "hook_sae_recons", "hook_sae_output"):
            out[f"cached.{name}"] = cache[f"{hook}.{name}"]
        out["cached.resid_post_last"] = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
        out["with_error.logits"] = model.run_with_saes(tokens, saes=[sae], use_error_term=True)
        sae.use_error_term = True  # the SAE's own setting, read when use_error_term is not given
        _, error_cache = model.run_with_cache_with_saes(tokens, saes=[sae])
        out["own_setting.error"] = error_cache[f"{hook}.hook_sae_error"]
        sae.use_error_term = False

        def ablate_feature(acts, hook):
            acts[:, :, 3] = 0.0
            return acts

        out["ablated.logits"] = model.run_with_hooks_with_saes(
            tokens, saes=[sae], fwd_hooks=[(f"{hook}.hook_sae_acts_post", ablate_feature)])
        with model.saes(saes=[sae]):
            out["block.logits"] = model(tokens)
        out["after_block.logits"] = model(tokens)
        model.add_sae(sae)
        out["attached.logits"] = model(tokens)
        out["attached.names"] = torch.tensor([len(model.acts_to_saes)])
        model.reset_saes()
        out["reset.logits"] = model(tokens)
    return out


def import_probe_from_the_repository() -> None:
    """probe's folders mapped to its packages as its editable install maps them (pyproject's package-dir), so this
    environment imports the repository's probe beside SAELens and transformer-lens 3."""
    import importlib.abc
    import importlib.util
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    folders = {"probe": "probe", "probe.hooks": "hooks", "probe.analyses": "analyses", "probe.cli": "scripts"}

    class RepositoryPackages(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in folders:
                return None  # modules inside the packages: found along each package's __path__
            folder = repo / folders[fullname]
            return importlib.util.spec_from_file_location(fullname, folder / "__init__.py",
                                                          submodule_search_locations=[str(folder)])

    sys.meta_path.insert(0, RepositoryPackages())


def probe_with_saelens_sae(model_dir: str, sae_dir: str, inputs: str, outputs: str) -> None:
    from sae_lens import SAE

    import_probe_from_the_repository()
    from probe import HookedDecoder

    model = HookedDecoder.from_pretrained(model_dir).eval()
    out = hooked_sae_idioms(model, SAE.load_from_disk(sae_dir, device="cpu"), load_file(inputs)["tokens"])
    save_file({k: v.clone().contiguous() for k, v in out.items()}, outputs)


def hooked_sae(model_dir: str, sae_dir: str, inputs: str, outputs: str) -> None:
    from sae_lens import SAE

    out = hooked_sae_idioms(hooked_gpt2(model_dir), SAE.load_from_disk(sae_dir, device="cpu"), load_file(inputs)["tokens"])
    save_file({k: v.clone().contiguous() for k, v in out.items()}, outputs)


def tl_config_cases(cases_json: str, inputs: str, outputs: str) -> None:
    import dataclasses

    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.utilities.activation_functions import gelu_fast

    data = load_file(inputs)
    tokens, out = data["tokens"], {"gelu_fast": gelu_fast(data["x"]).contiguous()}
    printed = {"fields": [f.name for f in dataclasses.fields(HookedTransformerConfig)], "text": {}}
    for name, case in json.loads(cases_json).items():
        cfg = HookedTransformerConfig(**case["config"], device="cpu")
        model = HookedTransformer(cfg).eval()
        moved_off_initialisation(model, 0.1)
        with torch.no_grad():
            out.update({f"{name}/state.{key}": t.detach().clone().contiguous() for key, t in model.state_dict().items()})
            out[f"{name}/logits"] = model(tokens).contiguous()
            for i, keywords in enumerate(case.get("generate", [])):
                keywords = dict(keywords)
                prompt = tokens if keywords.pop("from", "embeds") == "tokens" else model.embed(tokens)
                result = model.generate(prompt, do_sample=False, verbose=False, **keywords)
                if isinstance(result, torch.Tensor):
                    out[f"{name}/generate.{i}"] = result.clone().contiguous()
                else:
                    printed["text"][f"{name}/generate.{i}"] = result
        printed[name] = {key: str(v) if isinstance(v, torch.dtype) else v for key, v in model.cfg.to_dict().items()}
    save_file(out, outputs)
    print(json.dumps(printed))


def padding(model_dir: str, inputs: str, outputs: str) -> None:
    from transformers import AutoTokenizer

    model = hooked_gpt2(model_dir)
    model.set_tokenizer(AutoTokenizer.from_pretrained(model_dir))
    data = load_file(inputs)
    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"
    out = {}

    def record(case, tokens, **keywords):
        with torch.no_grad():
            logits, cache = model.run_with_cache(tokens, names_filter=last, **keywords)
            out[f"{case}/logits"] = model(tokens, **keywords).contiguous()
            out[f"{case}/resid"] = cache[last][:, -1].contiguous()
            out[f"{case}/loss"] = model(tokens, return_type="loss", **keywords).reshape(1)
            halved = [("blocks.0.hook_attn_out", lambda x, hook: x * 0.5)]
            out[f"{case}/hooked"] = model.run_with_hooks(tokens, fwd_hooks=halved, **keywords)[:, -1].contiguous()
        assert torch.equal(logits, out[f"{case}/logits"])

    # refusal-direction code: the tokenizer's padding side set, then the ids run with no keyword
    model.tokenizer.padding_side = "left"
    record("attribute", data["left"])
    record("right_kw_over_left_tokenizer", data["right"], padding_side="right")
    model.tokenizer.padding_side = "right"
    record("kw", data["left"], padding_side="left")
    record("kw_no_bos", data["left_nobos"], padding_side="left", prepend_bos=False)
    record("kw_bos_not_prepended", data["left"], padding_side="left", prepend_bos=False)
    record("right", data["right"])
    model.set_tokenizer(model.tokenizer, default_padding_side="left")
    record("set_tokenizer", data["left"])
    model.tokenizer.pad_token = model.tokenizer.convert_ids_to_tokens(1)
    record("pad_not_bos", data["left_pad1"])
    both = model(data["left"], return_type="both")
    model.tokenizer.padding_side, model.tokenizer.pad_token = "right", model.tokenizer.eos_token
    generated = {name: model.generate(prompt, max_new_tokens=3, do_sample=False, verbose=False, return_type="str")
                 for name, prompt in (("one_row", data["right"][1:]), ("two_rows", data["left"]), ("one_text", ["KING"]))}
    save_file(out, outputs)
    print(json.dumps({"both_type": type(both).__name__, "both_fields": list(both._fields), "generate": generated}))


TOKENIZER_TEXTS = ["Hello world", " Paris", "the cat sat on the mat, the cat"]


def tokenizer_idioms(model, padded: bool) -> dict:
    """What TL users' code reads off `model.tokenizer` and the model's token methods, written once: the oracle runs
    it on HookedTransformer, the tests on probe (tests/test_tokenizer_surface.py). `padded` adds the padded calls
    (for tokenizers whose pad token both libraries choose alike)."""
    tok, texts = model.tokenizer, TOKENIZER_TEXTS
    out = {"encode": [tok.encode(t) for t in texts], "encode_plain": [tok.encode(t, add_special_tokens=False) for t in texts],
           "encode_empty": tok.encode(""), "encode_pt": tok.encode(texts[0], return_tensors="pt").tolist(),
           "call_one": tok(texts[0])["input_ids"], "call_list": tok(texts)["input_ids"],
           "call_plain": tok(texts, add_special_tokens=False)["input_ids"],
           "call_truncated": tok(texts, truncation=True, max_length=3)["input_ids"],
           "decode": tok.decode(tok.encode(texts[0])), "decode_skip": tok.decode(tok.encode(texts[0]), skip_special_tokens=True),
           "batch_decode": tok.batch_decode([tok.encode(t) for t in texts], skip_special_tokens=True),
           "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
           "tokenizer_prepends_bos": model.cfg.tokenizer_prepends_bos,
           "to_tokens": model.to_tokens(texts[2]).tolist(), "to_tokens_no_bos": model.to_tokens(texts[2], prepend_bos=False).tolist(),
           "to_single_token": model.to_single_token(" Paris") if len(tok.encode(" Paris", add_special_tokens=False)) == 1 else None,
           "to_str_tokens": model.to_str_tokens(texts[0]),
           # SAELens's ActivationsStore tokenizes every dataset row so; wikitext has empty rows, which it skips
           "to_tokens_empty_row": list(model.to_tokens("", truncate=False, move_to_device=False, prepend_bos=False).shape)}
    if padded:
        batch = tok(texts, padding=True, return_tensors="pt")
        out["call_padded"] = [batch["input_ids"].tolist(), batch["attention_mask"].tolist()]
        tok.padding_side = "left"
        try:
            out["call_left"] = tok(texts, padding=True, return_tensors="pt").input_ids.tolist()
            out["to_tokens_left"] = model.to_tokens(texts).tolist()
            out["to_tokens_with_an_empty_row"] = model.to_tokens(["", texts[2]], prepend_bos=False).tolist()
        finally:
            tok.padding_side = "right"
        tok.pad_token = tok.eos_token  # refusal-direction scripts' first line
        out["pad_token_id"] = tok.pad_token_id
    return out


def tl_tokenizer(cases_json: str) -> None:
    """tokenizer_idioms on HookedTransformer(cfg, tokenizer=AutoTokenizer.from_pretrained(dir)) per case
    ({"dir", "architecture", "d_vocab", "padded"}), as JSON on stdout."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformers import AutoTokenizer

    printed = {}
    for name, case in json.loads(cases_json).items():
        cfg = HookedTransformerConfig(n_layers=1, d_model=8, n_ctx=64, d_head=4, n_heads=2, d_vocab=case["d_vocab"],
                                      act_fn="relu", attn_only=True, original_architecture=case["architecture"],
                                      device="cpu")
        model = HookedTransformer(cfg, tokenizer=AutoTokenizer.from_pretrained(case["dir"]))
        printed[name] = tokenizer_idioms(model, case["padded"])
    print(json.dumps(printed))


def ungrouped(cases_json: str, inputs: str, outputs: str) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from ungrouped_idioms import ungrouped_idioms  # beside this file: its folder is on sys.path

    tokens, out = load_file(inputs)["tokens"], {}
    for name, config in json.loads(cases_json).items():
        model = HookedTransformer(HookedTransformerConfig(**config, device="cpu")).eval()
        moved_off_initialisation(model, 0.3)
        out.update({f"{name}/state.{key}": t.detach().clone() for key, t in model.state_dict().items()})
        out.update({f"{name}/{key}": t for key, t in ungrouped_idioms(model, tokens).items()})
    save_file({k: v.detach().clone().contiguous() for k, v in out.items()}, outputs)


def kv_cache_loop(config_json: str, state: str, inputs: str, outputs: str, tokenizer_dir: str) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.cache.key_value_cache import TransformerLensKeyValueCache
    from transformers import AutoTokenizer

    from kv_cache_idioms import kv_cache_idioms  # beside this file: its folder is on sys.path

    # TL reads the padding off the ids with a cache, so it needs a tokenizer even for token ids
    model = HookedTransformer(HookedTransformerConfig(**json.loads(config_json), device="cpu"),
                              tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir)).eval()
    model.load_state_dict(load_file(state), strict=False)
    out = kv_cache_idioms(model, TransformerLensKeyValueCache, load_file(inputs)["tokens"])
    save_file({k: v.detach().clone().contiguous() for k, v in out.items()}, outputs)


def sae_surface(work_dir: str, inputs: str, outputs: str) -> None:
    from sae_lens import SAE, StandardSAE, StandardSAEConfig, TopKSAE, TopKSAEConfig
    from sae_lens.saes.sae import SAEMetadata

    from sae_surface_idioms import sae_surface_idioms  # beside this file: its folder is on sys.path

    z = load_file(inputs)["z"]  # [batch pos head d_head]
    d_in = z.shape[-2] * z.shape[-1]
    gen = torch.Generator().manual_seed(7)
    for name, config_class, sae_class, extra in (("z", StandardSAEConfig, StandardSAE, {"reshape_activations": "hook_z"}),
                                                ("topk", TopKSAEConfig, TopKSAE, {"k": 8})):
        hook = "blocks.1.attn.hook_z" if name == "z" else "blocks.1.hook_resid_post"
        sae = sae_class(config_class(d_in=d_in, d_sae=4 * d_in, metadata=SAEMetadata(
            hook_name=hook, model_name="tiny", hook_layer=1, prepend_bos=True, context_size=32), **extra))
        with torch.no_grad():
            for p in sae.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
        sae.save_model(f"{work_dir}/{name}")
    tensors, values = sae_surface_idioms(SAE, {"z": f"{work_dir}/z", "topk": f"{work_dir}/topk"}, z, f"{work_dir}/saved")
    save_file({k: v.detach().clone().contiguous() for k, v in tensors.items()}, outputs)
    print(json.dumps(values))


def saelens_tools(model_dir: str, sae_dir: str, outputs: str) -> None:
    from datasets import Dataset
    from sae_lens import SAE, ActivationsStore
    from sae_lens.evals import EvalConfig, run_evals
    from sae_lens.training.activation_scaler import ActivationScaler

    import_probe_from_the_repository()
    from probe import HookedDecoder, SparseAutoencoder

    model = HookedDecoder.from_pretrained(model_dir).eval()
    dataset = Dataset.from_dict({"text": ["The quick brown fox jumps over the lazy dog. " * 10] * 4})
    printed, out = {}, {}
    for sae_class in (SAE, SparseAutoencoder):
        sae = sae_class.load_from_disk(sae_dir)
        store = ActivationsStore.from_sae(model=model, sae=sae, dataset=dataset, streaming=False, context_size=16,
                                          store_batch_size_prompts=2, n_batches_in_buffer=2, train_batch_size_tokens=16,
                                          device="cpu")
        tokens = store.get_batch_tokens()
        out[f"{sae_class.__name__}/activations"] = store.get_activations(tokens).detach().clone().contiguous()
        torch.manual_seed(0)
        config = EvalConfig(n_eval_reconstruction_batches=1, n_eval_sparsity_variance_batches=1, compute_ce_loss=True,
                            compute_l2_norms=True, compute_sparsity_metrics=True, compute_variance_metrics=True)
        metrics, _ = run_evals(sae=sae, activation_store=store, model=model, activation_scaler=ActivationScaler(),
                               eval_config=config)
        printed[sae_class.__name__] = {"tokens": tokens.tolist(), "metrics": {
            f"{group}/{name}": float(value) for group, values in metrics.items() for name, value in values.items()}}
    save_file(out, outputs)
    print(json.dumps(printed))


def hook_listing(model_dir: str) -> None:
    """What HookedTransformer lists (hook_dict, mod_dict) and which names a hook on every hook_dict entry sees."""
    model = hooked_gpt2(model_dir)
    seen = []
    for point in model.hook_dict.values():
        point.add_hook(lambda x, hook: seen.append(hook.name))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    model.reset_hooks()
    with torch.no_grad():  # a cache of everything lists in the order activations arrive; without a return, no logits
        cached = {str(return_type): list(model.run_with_cache(torch.tensor([[1, 2, 3]]), return_type=return_type)[1].keys())
                  for return_type in ("logits", None)}
    print(json.dumps({"hook_dict": sorted(model.hook_dict), "mod_dict": sorted(name for name in model.mod_dict if name),
                      "seen": sorted(seen), "cached": cached}))


def tl_init(cases_json: str, outputs: str) -> None:
    """HookedTransformer(cfg) for each config, torch seeded with 11 between the two: its state dict and next draws."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    out = {}
    for name, config in json.loads(cases_json).items():
        cfg = HookedTransformerConfig(**config, device="cpu")  # seeds torch when it has a seed
        torch.manual_seed(11)  # init_weights seeds it again
        model = HookedTransformer(cfg)
        out[f"{name}/next"] = torch.randint(0, 1000, (8,))
        out.update({f"{name}/{key}": t.detach().clone().contiguous() for key, t in model.state_dict().items()})
    save_file(out, outputs)


def lens_handle_idioms(model) -> dict:
    """ACDC's reads of a hook point's handles (TLACDCExperiment.add_sender_hook): which functions a point carries,
    through torch's handle TL keeps for each (`fwd_hooks[i].hook.hooks_dict_ref()`, each module hook named after its
    function), then removing one through it; memory addresses left out of the names."""
    import re
    from functools import partial

    def sender_hook(x, hook, verbose=False):
        return x

    def receiver_hook(x, hook):
        return None

    name = "blocks.0.hook_resid_pre"
    model.add_hook(name, partial(sender_hook, verbose=True))
    model.add_hook(name, receiver_hook, is_permanent=True)
    handles = model.hook_dict[name].fwd_hooks
    dicts = [handle.hook.hooks_dict_ref() for handle in handles]
    out = {"same_dict": all(d == dicts[0] for d in dicts), "partials": [isinstance(f, partial) for f in dicts[0].values()],
           "names": [re.sub(r" at 0x[0-9a-f]+", "", f.__name__) for f in dicts[0].values()],
           "is_permanent": [handle.is_permanent for handle in handles],
           "context_level": [handle.context_level for handle in handles],
           "user_hook": [getattr(handle.user_hook, "__name__", "partial") for handle in handles],
           "ids": len({handle.hook.id for handle in handles})}
    handles[0].hook.remove()
    out["after_remove"] = [re.sub(r" at 0x[0-9a-f]+", "", f.__name__)
                           for f in model.hook_dict[name].fwd_hooks[0].hook.hooks_dict_ref().values()]
    model.reset_hooks(including_permanent=True)
    out["after_reset"] = len(model.hook_dict[name].fwd_hooks)
    return out


def lens_handles(config_json: str) -> None:
    """lens_handle_idioms on HookedTransformer(HookedTransformerConfig(**CONFIG)): stdout their JSON."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    print(json.dumps(lens_handle_idioms(HookedTransformer(HookedTransformerConfig(**json.loads(config_json))))))


def config_class(config_json: str) -> None:
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    from config_class_idioms import config_class_idioms  # beside this file: its folder is on sys.path

    model = HookedTransformer(HookedTransformerConfig(**json.loads(config_json), device="cpu"))
    print(json.dumps(config_class_idioms(model, HookedTransformer, HookedTransformerConfig)))


def tl_config_routes(cases_json: str, outputs: str) -> None:
    """For each config, HookedTransformer(config dict) and HookedTransformer(HookedTransformerConfig object), and
    probe's HookedDecoder given TL's object (only this environment has one): each one's state dict, and the draw
    after it, torch seeded with 11 just before the model (a config's seed draws again when the model initialises).
    Stdout: the JSON {NAME: the use_* and ungroup_* keys of TL's cfg.to_dict() and their values}."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    import_probe_from_the_repository()
    from probe import HookedDecoder

    out, switches = {}, {}
    for name, config in json.loads(cases_json).items():
        routes = {"tl_dict": (HookedTransformer, lambda: dict(config, device="cpu")),
                  "tl_object": (HookedTransformer, lambda: HookedTransformerConfig(**config, device="cpu")),
                  "probe_object": (HookedDecoder, lambda: HookedTransformerConfig(**config, device="cpu"))}
        for route, (model_class, cfg) in routes.items():
            cfg = cfg()
            torch.manual_seed(11)
            model = model_class(cfg)
            out[f"{name}/{route}/next"] = torch.randint(0, 1000, (8,))
            out.update({f"{name}/{route}/{key}": t.detach().clone().contiguous() for key, t in model.state_dict().items()})
        tl_cfg = HookedTransformerConfig(**config, device="cpu")
        switches[name] = {key: value for key, value in tl_cfg.to_dict().items() if key.startswith(("use_", "ungroup_"))}
    save_file(out, outputs)
    print(json.dumps(switches))


COMMANDS = {"auto_circuit_scores": auto_circuit_scores, "config_class": config_class, "lens_handles": lens_handles, "tl_config_routes": tl_config_routes, "weight_grads": weight_grads, "hook_listing": hook_listing, "tl_init": tl_init, "probe_with_saelens_sae": probe_with_saelens_sae, "schedules": schedules, "encode": encode, "loss": loss, "fold": fold, "hooked_sae": hooked_sae, "tl_state_dict": tl_state_dict,
            "tl_build": tl_build, "toy_idioms": toy, "state_steps": state_steps, "sae_splice": sae_splice, "patch_wrappers": patch_wrappers, "attention_buffers": attention_buffers, "circuit_tracer_graphs": circuit_tracer_graphs, "induction": induction, "brackets": brackets, "neel": neel,
            "tl_cache": tl_cache, "tl_caches": tl_caches, "circuits": circuits, "tl_config_cases": tl_config_cases,
            "padding": padding, "tl_tokenizer": tl_tokenizer, "ungrouped": ungrouped, "kv_cache_loop": kv_cache_loop, "gpt_oss_demo": gpt_oss_demo, "sae_surface": sae_surface, "saelens_tools": saelens_tools}


def serve() -> None:
    """Run commands sent one JSON line at a time on stdin ({"args": [COMMAND, ...], "stdout": PATH, "stderr": PATH}),
    each in a child forked after the imports every command needs: importing transformer-lens 3 and SAELens costs ~7 s,
    more than most commands, and a fresh child per command keeps them as isolated as separate processes. Answers each
    with the JSON line {"rc": EXIT_CODE} on stdout, the only thing the server itself writes there."""
    import os
    import traceback

    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever an import prints must not reach the client as an answer
    import sae_lens  # noqa: F401  (imported for the children)
    import transformer_lens  # noqa: F401
    import transformers  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                out, err = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT), os.open(request["stderr"], os.O_WRONLY | os.O_CREAT)
                os.dup2(out, 1)
                os.dup2(err, 2)
                command, *args = request["args"]
                # the imports leave torch's generator in a different state each session, and a command that builds
                # HookedTransformer without a seed draws its weights from it: reseeded, every session sees the same
                torch.manual_seed(0)
                COMMANDS[command](*args)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    serve() if command == "serve" else COMMANDS[command](*args)
