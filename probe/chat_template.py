"""Chat templates rendered as transformers renders them: the checkpoint's jinja2 template in a sandbox, with
transformers' globals (`raise_exception`, `strftime_now`) and its `tojson` (no HTML escaping). jinja2 comes with
torch, so this needs nothing more."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Union

Conversation = list[dict]


def render_chat(template, conversation: Union[Conversation, list[Conversation]], add_generation_prompt: bool,
                continue_final_message: bool, variables: dict, source: str) -> Union[str, list[str]]:
    """The text of one conversation (a list of {"role", "content"} dicts), or one per conversation of a list."""
    if template is None:
        raise ValueError(f"the tokenizer of {source or 'this model'} has no chat template (tokenizer_config.json's "
                         "chat_template, or chat_template.jinja); pass chat_template='...' (a jinja2 template)")
    batched = isinstance(conversation, (list, tuple)) and bool(conversation) and isinstance(conversation[0], (list, tuple))
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message continues the last message; add_generation_prompt starts a new one: "
                         "pass one of them")
    unsupported = sorted(key for key in ("tools", "documents", "return_assistant_tokens_mask", "tokenizer_kwargs")
                         if variables.get(key))
    if unsupported:
        raise TypeError(f"apply_chat_template here does not take {unsupported}: render with transformers' tokenizer "
                        "(AutoTokenizer.from_pretrained(model_dir).apply_chat_template(...)) and pass its ids to the model")
    compiled = _compiled(template)
    texts = []
    for chat in conversation if batched else [conversation]:
        chat = [dict(message) for message in chat]
        text = compiled.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
        if continue_final_message:
            # end the text where the last message's content ends, dropping its end-of-turn tokens
            final = chat[-1]["content"] if chat and isinstance(chat[-1].get("content"), str) else None
            if not final or final.strip() not in text:
                raise ValueError("continue_final_message needs a final message whose text content the template writes")
            text = text[: text.rindex(final.strip()) + len(final.strip())]
        texts.append(text)
    return texts if batched else texts[0]


@lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(template)
