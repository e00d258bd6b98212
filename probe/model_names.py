"""The names `from_pretrained` knows besides a directory or a hub repository: transformer-lens's short names (and
its other spellings) for checkpoints of the supported families, each mapped to its hub repository. Tested against
transformer-lens 4's own alias table (tests/test_tl_loading.py)."""
from __future__ import annotations

# short names, as transformer-lens spells them -> hub repositories
SHORT_NAMES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
    **{f"pythia-{size}{dedup}": f"EleutherAI/pythia-{size}{dedup}"
       for size in ("14m", "31m", "70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b")
       for dedup in ("", "-deduped")},
    # gated on the hub: accept Google's licence there, then `hf auth login` (or pass a downloaded directory)
    **{f"{name}{it}": f"google/{name}{it}" for name in ("gemma-2b", "gemma-7b", "gemma-2-2b", "gemma-2-9b", "gemma-2-27b",
                                                         "gemma-3-270m")
       for it in ("", "-it")},
    **{f"gemma-3-{size}-{kind}": f"google/gemma-3-{size}-{kind}" for size in ("1b", "4b", "12b", "27b")
       for kind in ("pt", "it")},
}
_STANFORD_RUNS = [(size, letter, f"{run}-gpt2-{size}-x{seed}")
                  for size, runs in (("small", ("alias", "battlestar", "caprica", "darkmatter", "expanse")),
                                     ("medium", ("arwen", "beren", "celebrimbor", "durin", "eowyn")))
                  for letter, run, seed in zip("abcde", runs, (21, 49, 81, 343, 777))]
# transformer-lens's other spellings of the same checkpoints, and its short names for other supported families
SHORT_NAMES.update({
    "gpt2-small": "openai-community/gpt2",
    **{alias: "distilbert/distilgpt2" for alias in ("distillgpt2", "distill-gpt2", "distil-gpt2", "gpt2-xs")},
    # Pythia's first names (sizes counted without the embeddings), its v0 runs, and plain "pythia" for the smallest
    **{f"pythia-{old}{kind}": f"EleutherAI/pythia-{size}{kind}"
       for old, size in (("19m", "70m"), ("125m", "160m"), ("350m", "410m"), ("800m", "1b"), ("1.3b", "1.4b"),
                         ("2.7b", "2.8b"), ("6.7b", "6.9b"), ("13b", "12b"))
       for kind in ("", "-deduped", "-v0", "-deduped-v0")},
    **{f"pythia-{size}{kind}": f"EleutherAI/pythia-{size}{kind}"
       for size in ("70m", "160m", "410m", "1b", "1.4b", "2.8b", "6.9b", "12b") for kind in ("-v0", "-deduped-v0")},
    "pythia": "EleutherAI/pythia-70m", "pythia-v0": "EleutherAI/pythia-70m-v0",
    **{f"pythia-{size}-seed{seed}": f"EleutherAI/pythia-160m-seed{seed}" for size in ("160m", "125m") for seed in (1, 2, 3)},
    # Stanford CRFM's GPT-2 runs (five seeds per size), each with its training checkpoints as revisions
    **{f"stanford-gpt2-{size}-{letter}": f"stanford-crfm/{run}" for size, letter, run in _STANFORD_RUNS},
    **{run: f"stanford-crfm/{run}" for _, _, run in _STANFORD_RUNS},
    **{f"Llama-2-{size}{chat}": f"meta-llama/Llama-2-{size}{chat}-hf" for size in ("7b", "13b")
       for chat in ("", "-chat")},
    "Llama-2-70b-chat": "meta-llama/Llama-2-70b-chat-hf",
    "mistral-7b": "mistralai/Mistral-7B-v0.1", "mistral-7b-instruct": "mistralai/Mistral-7B-Instruct-v0.1",
    **{f"qwen1.5-{size}{chat.lower()}": f"Qwen/Qwen1.5-{size.upper()}{chat}"
       for size in ("0.5b", "1.8b", "4b", "7b", "14b") for chat in ("", "-Chat")},
    **{f"qwen2-{size}{it.lower()}": f"Qwen/Qwen2-{size.upper()}{it}" for size in ("0.5b", "1.5b", "7b")
       for it in ("", "-Instruct")},
    **{f"qwen2.5-{size}{it.lower()}": f"Qwen/Qwen2.5-{size.upper()}{it}"
       for size in ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b") for it in ("", "-Instruct")},
    **{f"qwen3-{size}": f"Qwen/Qwen3-{size.upper()}" for size in ("0.6b", "1.7b", "4b", "8b", "14b")},
    "qwen3-0.6b-base": "Qwen/Qwen3-0.6B-Base",
    "olmo-1b": "allenai/OLMo-1B-hf", "olmo-7b": "allenai/OLMo-7B-hf",
    "olmo-2-1b": "allenai/OLMo-2-0425-1B", "olmo-2-7b": "allenai/OLMo-2-1124-7B",
    # GPT-Neo (EleutherAI), the TinyStories models (GPT-Neo's architecture; one repository is spelled "Instuct" on
    # the hub) and OPT (Meta), with transformer-lens's aliases for each
    **{alias: f"EleutherAI/gpt-neo-{size}" for size, aliases in (("125M", ("small", "neo-small", "neo")),
                                                                  ("1.3B", ("medium", "neo-medium")),
                                                                  ("2.7B", ("large", "neo-large")))
       for alias in (f"gpt-neo-{size}", *(a if a.startswith("neo") else f"gpt-neo-{a}" for a in aliases))},
    **{f"tiny-stories{kind.lower()}-{size}": f"roneneldan/TinyStories{kind}-{size}"
       for kind in ("", "-Instruct") for size in ("1M", "3M", "8M", "28M", "33M")},
    "tiny-stories-1L-21M": "roneneldan/TinyStories-1Layer-21M", "tiny-stories-2L-33M": "roneneldan/TinyStories-2Layers-33M",
    "tiny-stories-instruct-1L-21M": "roneneldan/TinyStories-Instuct-1Layer-21M",
    "tiny-stories-instruct-2L-33M": "roneneldan/TinyStories-Instruct-2Layers-33M",
    **{alias: f"facebook/opt-{size}" for size, aliases in (("125m", ("small", "")), ("1.3b", ("medium",)),
                                                            ("2.7b", ("large",)), ("6.7b", ("xl",)), ("13b", ("xxl",)),
                                                            ("30b", ("xxxl",)), ("66b", ("xxxxl",)))
       for alias in (f"opt-{size}", *(f"opt-{a}" if a else "opt" for a in aliases))},
    **{f"phi-{v}": f"microsoft/phi-{v}" for v in ("1", "1_5", "2")},  # Phi (Microsoft), TL's names
    "phi-3": "microsoft/Phi-3-mini-4k-instruct", "phi-4": "microsoft/phi-4",
    **{alias: "EleutherAI/gpt-j-6B" for alias in ("gpt-j-6B", "gpt-j", "gptj")},
    **{f"bloom-{size}": f"bigscience/bloom-{size}" for size in ("560m", "1b1", "1b7", "3b", "7b1")},  # BigScience's
    # mixtures of experts
    **{alias: "mistralai/Mixtral-8x7B-v0.1" for alias in ("mixtral", "mixtral-8x7b")},
    **{alias: "mistralai/Mixtral-8x7B-Instruct-v0.1" for alias in ("mixtral-instruct", "mixtral-8x7b-instruct")},
    "olmoe": "allenai/OLMoE-1B-7B-0924",
    **{alias: "openai/gpt-oss-20b" for alias in ("gpt-oss", "gpt-oss-20b")},
    **{alias: f"swiss-ai/Apertus-8B{kind}-2509" for kind, aliases in (("", ("apertus-8b", "apertus")),
                                                                     ("-Instruct", ("apertus-8b-instruct", "apertus-instruct")))
       for alias in aliases},
    # Neel Nanda's toy models, in transformer-lens's own format (probe.checkpoint_tl); TL's names for them
    **{f"{kind}-{n}l{alias}": f"NeelNanda/{repo}_{n}L512W_C4_Code" for kind, repo in (("attn-only", "Attn_Only"),
                                                                                    ("gelu", "GELU"))
       for n in range(1, 5) for alias in ("", "-new", "-c4-code")},
    **{alias: "NeelNanda/Attn-Only-2L512W-Shortformer-6B-big-lr"
       for alias in ("attn-only-2l-demo", "attn-only-2l-shortformer-6b-big-lr", "attn-only-2l-induction-demo",
                     "attn-only-demo")},
    "redwood_attn_2l": "ArthurConmy/redwood_attn_2l",  # Redwood's attention-only model, the same format (ACDC's)
    # SoLU-LN MLPs (act_fn="solu_ln"): the C4 + code runs by width, two Wikipedia fine-tunes, and the older Pile runs
    # (repositories named _old, whose tensors TL converts on loading: probe.checkpoint_tl.convert_solu_old)
    **{f"solu-{n}l{alias}": f"NeelNanda/SoLU_{n}L{width}W_C4_Code"
       for n, width in ((1, 512), (2, 512), (3, 512), (4, 512), (6, 768), (8, 1024), (10, 1280), (12, 1536))
       for alias in ("", "-new", "-c4-code")},
    **{f"solu-{n}l-{alias}": f"NeelNanda/SoLU_{n}L512W_Wiki_Finetune" for n in (1, 4)
       for alias in ("wiki", "wiki-finetune", "finetune")},
    **{f"solu-{n}l-{alias}": f"NeelNanda/SoLU_{n}L_v{version}_old"
       for n, version in ((1, 9), (2, 10), (4, 11), (6, 13), (8, 21), (10, 22), (12, 23)) for alias in ("pile", "old")},
})

# transformer-lens's other names for checkpoints of these families (its alias table, tested against it): Pythia's
# old sizes spelled as repositories, GPT-NeoX-20B, StableLM (GPT-NeoX), Yi and Code Llama (Llama), mGPT (GPT-2),
# MedGemma (Gemma 3), and the Stanford runs' other spellings
SHORT_NAMES.update({
    **{f"EleutherAI/pythia-{old}{kind}": f"EleutherAI/pythia-{size}{kind}"
       for old, size in (("19m", "70m"), ("125m", "160m"), ("350m", "410m"), ("800m", "1b"), ("1.3b", "1.4b"),
                         ("2.7b", "2.8b"), ("6.7b", "6.9b"), ("13b", "12b"))
       for kind in ("", "-deduped", "-v0", "-deduped-v0")},
    **{f"EleutherAI/pythia-125m-seed{seed}": f"EleutherAI/pythia-160m-seed{seed}" for seed in (1, 2, 3)},
    **{alias: "EleutherAI/gpt-neox-20b" for alias in ("gpt-neox-20b", "gpt-neox", "neox")},
    **{alias: f"stabilityai/stablelm-{kind}-alpha-{size}" for kind in ("base", "tuned") for size in ("3b", "7b")
       for alias in (f"stablelm-{kind}-alpha-{size}", f"stablelm-{kind}-{size}")},
    **{alias: f"01-ai/Yi-{size}{chat}" for size in ("6B", "34B") for chat in ("", "-Chat")
       for alias in (f"Yi-{size}{chat}", f"yi-{size.lower()}{chat.lower()}")},
    "CodeLlamallama-2-7b": "codellama/CodeLlama-7b-hf",  # transformer-lens's own spelling
    "CodeLlama-7b-instruct": "codellama/CodeLlama-7b-Instruct-hf",
    "CodeLlama-7b-python": "codellama/CodeLlama-7b-Python-hf",
    "meta-llama-2-70b-chat-hf": "meta-llama/Llama-2-70b-chat-hf",
    "mistral-nemo-base-2407": "mistralai/Mistral-Nemo-Base-2407", "qwen-32b-preview": "Qwen/QwQ-32B-Preview",
    "mGPT": "ai-forever/mGPT",
    **{f"olmo-{name.lower()}": f"allenai/Olmo-{name}" for name in ("3-1025-7B", "3-1125-32B", "3-32B-Think",
                                                                     "3-7B-Instruct", "3-7B-Think", "3.1-32B-Instruct",
                                                                     "3.1-32B-Think")},
    **{f"medgemma-{name}": f"google/medgemma-{name}" for name in ("4b-it", "4b-pt", "27b-it", "27b-text-it")},
    **{f"gpt2-{spelling}-{letter}": f"stanford-crfm/{run}" for size, letter, run in _STANFORD_RUNS
       for spelling in ((f"stanford-{size}",) + (("mistral-small",) if size == "small" else ("medium-small",)))},
})
