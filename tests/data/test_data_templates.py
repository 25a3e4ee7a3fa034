"""Chat templates: the exact prompt frames of configs/model/templates.json, rendered and tokenised."""

from __future__ import annotations

import json

import pytest
from data_support import R1_FRAME_HEAD, R1_FRAME_TAIL

from services.common.errors import DataError
from services.data.templates import (
    DEFAULT_TEMPLATES_PATH,
    get_template,
    load_templates,
    parse_template,
)

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
ASSISTANT_HEADER = R1_FRAME_TAIL
# The R1-Zero instruction MindSpeed-RL's qwen_r1 puts before the problem (configs/model/templates.json).
R1_INSTRUCTION = R1_FRAME_HEAD.removeprefix(SYSTEM + "<|im_start|>user\n")


def test_required_templates_exist_and_all_parse():
    names = set(load_templates())
    assert {"empty", "qwen", "qwen_r1", "qwen_math_r1", "qwen3", "llama3", "deepseek3"} <= names
    # Every entry of the upstream file parses (load_templates validates each one).
    assert len(names) == len(json.loads(DEFAULT_TEMPLATES_PATH.read_text()))


@pytest.mark.parametrize(("name", "system", "expected"), [
    # qwen: ChatML with the default system message.
    ("qwen", "", SYSTEM + "<|im_start|>user\nWhat is 1+1?" + ASSISTANT_HEADER),
    # a system text from the data replaces the default one.
    ("qwen", "Be terse.", "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nWhat is 1+1?"
     + ASSISTANT_HEADER),
    # qwen_r1: the same frame with the R1 instruction before the problem.
    ("qwen_r1", "", SYSTEM + "<|im_start|>user\n" + R1_INSTRUCTION + "What is 1+1?" + ASSISTANT_HEADER),
    # qwen_math_r1: the instruction lives in the default system message.
    ("qwen_math_r1", "", "<|im_start|>system\nPlease reason step by step, and put your final answer within "
     "\\boxed{}.<|im_end|>\n<|im_start|>user\nWhat is 1+1?" + ASSISTANT_HEADER),
    # qwen3: no default system, so no system turn.
    ("qwen3", "", "<|im_start|>user\nWhat is 1+1?" + ASSISTANT_HEADER),
    # empty: the content verbatim.
    ("empty", "", "What is 1+1?"),
    # llama3: a bos slot (rendered from the tokenizer, absent here) then the header frame.
    ("llama3", "", "<|start_header_id|>user<|end_header_id|>\n\nWhat is 1+1?<|eot_id|>"
     "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    ("deepseek3", "", "<\uff5cUser\uff5c>What is 1+1?<\uff5cAssistant\uff5c>"),
])
def test_render_prompt_frames(name, system, expected):
    assert get_template(name).render_prompt("What is 1+1?", system) == expected


def test_encode_prompt_decodes_to_rendered_text_and_tokenises_slot_by_slot(tiny_tokenizer, decode):
    tpl = get_template("qwen_r1")
    problem = "Let $x^2 = 4$. Find $x > 0$."
    ids = tpl.encode_prompt(tiny_tokenizer, problem)
    assert decode(ids) == tpl.render_prompt(problem)
    assert decode(ids).endswith("<|im_start|>assistant\n")
    # Upstream tokenises each slot on its own: system slot ids, then user slot ids.
    system_ids = tiny_tokenizer.encode(SYSTEM, add_special_tokens=False)
    user_ids = tiny_tokenizer.encode("<|im_start|>user\n" + R1_INSTRUCTION + problem + ASSISTANT_HEADER,
                                     add_special_tokens=False)
    assert ids == system_ids + user_ids
    assert tiny_tokenizer.convert_tokens_to_ids("<|im_start|>") in ids  # special tokens are single ids


def test_bos_slot_uses_the_tokenizer_bos_when_it_has_one(tiny_model_dir):
    from transformers import AutoTokenizer

    with_bos = AutoTokenizer.from_pretrained(tiny_model_dir, bos_token="<|endoftext|>")
    bos_id = with_bos.convert_tokens_to_ids("<|endoftext|>")
    ids = get_template("llama3").encode_prompt(with_bos, "hi")
    assert ids[0] == bos_id
    assert get_template("llama3").render_prompt("hi", tokenizer=with_bos).startswith("<|endoftext|><|start_header")


def test_content_is_inserted_once_and_not_rescanned():
    tpl = parse_template({"name": "t", "format_user": {"slots": ["[{{content}}|{{idx}}|{{content}}]"]}})
    # Only the first {{content}} is replaced, as upstream; text inside the content is left alone.
    assert tpl.render_prompt("a {{idx}} b") == "[a {{idx}} b|0|{{content}}]"


def test_llama2_puts_the_system_text_inside_the_user_turn():
    # MindSpeed-RL's Llama2Template formats the system text and prepends it to the user content.
    assert get_template("llama2").render_prompt("Q", "S") == "[INST] <<SYS>>\nS\n<</SYS>>\n\nQ [/INST]"


def test_unknown_template_lists_valid_names():
    with pytest.raises(DataError, match=r"unknown prompt_type 'qwen_r2'.*valid names: .*qwen_r1"):
        get_template("qwen_r2")


@pytest.mark.parametrize(("raw", "match"), [
    ({"name": "t", "format_user": {"slots": ["no placeholder"]}}, "needs a placeholder"),
    ({"name": "t", "format_prefix": {"slots": ["{{content}}"]}}, "must not contain placeholders"),
    ({"name": "t", "format_prefix": {"slots": [["cls_token"]]}}, "may only name"),
    ({"name": "t", "format_usr": {"slots": ["{{content}}"]}}, "unknown keys \\['format_usr'\\]"),
    ({"format_user": {"slots": ["{{content}}"]}}, "needs a non-empty string `name`"),
])
def test_bad_templates_are_rejected_with_the_reason(raw, match):
    with pytest.raises(DataError, match=match):
        parse_template(raw)


def test_templates_file_errors(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text('[{"name": "a",\n "format_user": }]')
    with pytest.raises(DataError, match=r"t.json: not valid JSON at line 2 column 17"):
        load_templates(bad)
    with pytest.raises(DataError, match="not found"):
        load_templates(tmp_path / "missing.json")
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps([{"name": "a"}, {"name": "a"}]))
    with pytest.raises(DataError, match="defined twice"):
        load_templates(dup)
