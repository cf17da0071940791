"""Tokenizer, chat template and incremental detokenization against transformers, on a BPE
trained in the fixture; text prompts through LLM."""
import copy
import json
import pickle
import random
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

import diffuserve as ds
from diffuserve.chat_template import ChatTemplateError
from diffuserve.detokenizer import IncrementalDetokenizer, until_eos
from diffuserve.stop_strings import StopStringFilter
from diffuserve.tokenizer import Tokenizer

from chat_checkpoint import CHAT_TEMPLATE, CLEAN_UP_CORPUS, write_chat_checkpoint, write_clean_up_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "東京は？ 😀"},
     {"role": "assistant", "content": "Big city."}, {"role": "user", "content": "And more?"}],
]
TEXTS = ["Hello world", "café naïve Zürich", "東京は大きな都市です。你好世界", "😀🎉🚀👍🏽❤️ ok", "mixed 日本 and 😀 emoji",
         "unseen, so byte by byte: 🦄鯨∑"]


@pytest.fixture(scope="module", params=["tokenizer_config", "jinja_file", "byte_fallback"])
def checkpoint(request, tmp_path_factory):
    return write_chat_checkpoint(tmp_path_factory.mktemp("chat"), template_file=request.param == "jinja_file",
                                 byte_fallback=request.param == "byte_fallback")


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(checkpoint, conversation, add_generation_prompt):
    ours = Tokenizer(checkpoint)
    theirs = AutoTokenizer.from_pretrained(checkpoint)
    text = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert text == theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = theirs.apply_chat_template(conversation, tokenize=True, add_generation_prompt=add_generation_prompt,
                                     return_dict=False)
    assert ours.encode(text, add_special_tokens=False) == list(ids)


def test_encode_decode_match_transformers(checkpoint):
    ours, theirs = Tokenizer(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    assert ours.eos_token_id == theirs.eos_token_id == 1
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text)
        assert ours.encode(text)[0] == 2  # the post-processor's <bos>
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True) == text


def test_long_text_encodes_as_transformers_does(checkpoint):
    """A text past the length from which encoding lets go of the GIL gives the same ids."""
    from diffuserve.tokenizer import _LONG_TEXT
    ours, theirs = Tokenizer(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    text = " ".join(TEXTS) * (_LONG_TEXT // len(" ".join(TEXTS)) + 1)
    assert len(text) >= _LONG_TEXT
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)


def test_chat_template_argument_as_transformers(checkpoint, tmp_path):
    """chat_template, as in transformers: a template to use instead of the checkpoint's, or
    the name of one of its named templates; anything else is refused (it had reached the
    template as a variable and been ignored, a string too). tokenize must be False."""
    import json
    import shutil
    path = shutil.copytree(checkpoint, tmp_path / "m")
    config = json.loads((path / "tokenizer_config.json").read_text())
    own = CHAT_TEMPLATE if (path / "chat_template.jinja").exists() else config["chat_template"]
    short = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config["chat_template"] = [{"name": "default", "template": own}, {"name": "short", "template": short}]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    conversation = CONVERSATIONS[1]
    for template in (None, "short", "<{{ bos_token }}{{ messages | length }}>", short):
        assert ours.apply_chat_template(conversation, chat_template=template) == \
            theirs.apply_chat_template(conversation, chat_template=template, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(conversation, chat_template="short", tokenize=False).startswith("[system]")
    with pytest.raises(ValueError, match=r"chat_template must be a Jinja template or a template's name \(a string\), "
                                         r"got 5"):
        ours.apply_chat_template(conversation, chat_template=5)
    with pytest.raises(ValueError, match="tokenize must be False .* got True"):
        ours.apply_chat_template(conversation, tokenize=True)


FIELDS_TEMPLATE = ("{% for m in messages %}[{{ m.role }} {{ m.name is defined }} {{ 'tool_calls' in m }} "
                   "{{ m.reasoning_content }} {{ m.thinking }}]{% generation %}{{ m.content }}{% endgeneration %}"
                   "{% endfor %}")


@pytest.mark.parametrize("kwargs", [{"add_generation_prompt": False}, {"continue_final_message": True}])
@pytest.mark.parametrize("template", [None, FIELDS_TEMPLATE])
def test_chat_template_messages_as_transformers_passes_them(checkpoint, template, kwargs):
    """As transformers: keys whose value is None are not there, reasoning reaches the template
    as reasoning_content and thinking, {% generation %} renders its body, and
    continue_final_message ends the text inside the final message (no end of turn); had
    been: None values defined, reasoning under its own name only, a template that did not
    compile, and continue_final_message a variable the template ignored."""
    ours, theirs = Tokenizer(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    conversation = [{"role": "user", "content": "Hi <start_of_turn>", "name": None, "tool_calls": None},
                    {"role": "assistant", "content": "Partly ", "thinking": "hmm"}]
    text = ours.apply_chat_template(conversation, chat_template=template, **kwargs)
    assert text == theirs.apply_chat_template(conversation, chat_template=template, tokenize=False, **kwargs)
    ids = theirs.apply_chat_template(conversation, chat_template=template, return_dict=False, **kwargs)
    assert ours.encode(text, add_special_tokens=False) == list(ids)
    if kwargs.get("continue_final_message"):
        assert text.endswith("Partly" if template is None else "Partly ")
        parts = [{**conversation[0], "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
        assert ours.apply_chat_template(parts, chat_template=template, **kwargs) == \
            theirs.apply_chat_template(parts, chat_template=template, tokenize=False, **kwargs)


def test_chat_template_takes_transformers_tokenizing_keywords_as_it_does(checkpoint):
    """transformers' apply_chat_template keywords for its tokenized output reach no template
    (they had been template variables: padding, max_length, ... printed by a template that
    names them), and those it refuses without tokenizing are refused; a final message's parts
    given as a tuple stay a tuple under continue_final_message (they had become a list)."""
    ours, theirs = Tokenizer(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    template = "{{ padding }}/{{ max_length }}/{{ return_dict }}/{{ truncation }}{{ messages[0].content }}"
    conversation = [{"role": "user", "content": "hi"}]
    keywords = dict(padding="max_length", truncation=True, max_length=8, return_tensors="np", return_dict=False,
                    tokenizer_kwargs={"padding_side": "left"})
    text = ours.apply_chat_template(conversation, chat_template=template, **keywords)
    assert text == theirs.apply_chat_template(conversation, chat_template=template, tokenize=False, **keywords)
    assert text == "///hi"
    for name in ("sanitize_control_tokens", "return_assistant_tokens_mask"):
        with pytest.raises(ValueError):
            theirs.apply_chat_template(conversation, tokenize=False, **{name: True})
        with pytest.raises(ValueError, match=f"{name}=True needs tokenize=True"):
            ours.apply_chat_template(conversation, **{name: True})
        assert ours.apply_chat_template(conversation, **{name: False}) == ours.apply_chat_template(conversation)
    parts = [{"role": "assistant", "content": ({"type": "text", "text": "ab"},)}]
    kwargs = dict(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}", continue_final_message=True)
    assert ours.apply_chat_template(parts, **kwargs) == theirs.apply_chat_template(parts, tokenize=False, **kwargs)


def test_chat_template_arguments_refused(checkpoint):
    tokenizer = Tokenizer(checkpoint)
    with pytest.raises(ChatTemplateError, match="the conversation is empty"):
        tokenizer.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="continue_final_message and add_generation_prompt exclude each other"):
        tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="continue_final_message must be True, False or the name of the final "
                                                "message's field to continue, got 1"):
        tokenizer.apply_chat_template(CONVERSATIONS[0], continue_final_message=1)
    with pytest.raises(ChatTemplateError, match="the final message has no text to continue"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], continue_final_message=True)
    # The last part with a text is the one continued (as transformers picks it), not an earlier one
    with pytest.raises(ChatTemplateError, match="the final message's last text part's 'text' is NoneType, not text"):
        tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": None}]}],
                                      continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="message 1 must be a dict, got str"):
        tokenizer.apply_chat_template([CONVERSATIONS[0][0], "hi"])


def test_chat_template_sees_the_named_special_tokens_transformers_passes(checkpoint, tmp_path):
    """A model's own "..._token" keys (Gemma 3's boi_token) and the named extra_special_tokens
    (which win) reach the template, as in transformers 5; only the standard seven had."""
    import json
    import shutil
    path = shutil.copytree(checkpoint, tmp_path / "m")
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(boi_token="<start_of_turn>", eoi_token={"__type": "AddedToken", "content": "<end_of_turn>"},
                  extra_special_tokens={"image_token": "<pad>", "boi_token": "<eos>"},
                  chat_template="{{ boi_token }}{{ eoi_token }}{{ image_token }}{{ messages[0].content }}")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    text = ours.apply_chat_template(CONVERSATIONS[0])
    assert text == theirs.apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True)
    assert text == "<eos><end_of_turn><pad>Hello!"


@pytest.mark.parametrize("bad", [-1, "vocab_size", 2**31, 2**64])
def test_decode_refuses_ids_outside_the_vocabulary(checkpoint, bad):
    """decode names an id outside the vocabulary (the tokenizers library writes nothing for
    one past it); a model's output, whose embedding may have rows past the vocabulary, is
    decoded without them (decode_output: LLM's text, the server's stream)."""
    tokenizer = Tokenizer(checkpoint)
    vocab = tokenizer.vocab_size
    bad = vocab if bad == "vocab_size" else bad
    with pytest.raises(ValueError, match=rf"decode: token id {bad} at index 1 is out of range \[0, {vocab}\)"):
        tokenizer.decode([40, bad, 41])
    with pytest.raises(ValueError, match="decode: token ids must be integers"):
        tokenizer.decode(["a"])
    assert tokenizer.decode_output([40, vocab, vocab + 100, 41]) == tokenizer.decode([40, 41])


def test_template_raise_exception(checkpoint):
    with pytest.raises(ChatTemplateError, match="unknown role: tool"):
        Tokenizer(checkpoint).apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_incremental_detokenization_never_splits_a_character(checkpoint, chunk):
    tokenizer = Tokenizer(checkpoint)
    partial = [i for i in tokenizer.encode(TEXTS[-1]) if "\ufffd" in tokenizer.decode([i])]
    assert len(partial) >= 6  # characters outside the training corpus really are split into byte tokens
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detokenizer = IncrementalDetokenizer(tokenizer)
        pieces = [detokenizer.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [detokenizer.finish()]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenization_of_random_tokens(checkpoint, skip_special_tokens):
    """Any tokens, in any pieces, stream as the decode of them all: byte tokens that are no
    valid UTF-8 (a byte-fallback run then decodes to one U+FFFD per byte, the valid characters
    before the bad byte too), special tokens, ids past the vocabulary."""
    tokenizer = Tokenizer(checkpoint)
    vocab = tokenizer.vocab_size
    byte_tokens = [i for i in range(vocab) if "\ufffd" in tokenizer.decode([i])]
    pool = byte_tokens * 3 + list(range(vocab + 2))
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 16))]
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        pieces, done = [], 0
        while done < len(ids):
            step = rng.randrange(1, 4)
            pieces.append(detokenizer.push(ids[done:done + step]))
            done += step
        text = "".join(pieces) + detokenizer.finish()
        assert text == tokenizer.decode_output(ids, skip_special_tokens=skip_special_tokens), ids


def test_tokens_without_text_stay_out_of_the_windows(checkpoint, monkeypatch):
    """Skipped special tokens and ids past the vocabulary change no other token's text, so the
    windows decoded at each push leave them out: a long run of them costs each push a short
    decode (each push had decoded the whole run again: 16,000 pad tokens took 1.9 s), and the
    text is the same. A run of byte tokens still waits whole (an invalid byte to come would
    turn it all into U+FFFDs)."""
    tokenizer = Tokenizer(checkpoint)
    special = next(iter(tokenizer._special_ids))
    decoded = []
    decode = tokenizer._decode
    monkeypatch.setattr(tokenizer, "_decode", lambda ids, *rest: decoded.append(len(ids)) or decode(ids, *rest))
    detokenizer = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    text = detokenizer.push(ids)
    for _ in range(400):
        run = [special, tokenizer.vocab_size + 3, special]
        ids += run
        text += detokenizer.push(run)
    tail = tokenizer.encode(" and again", add_special_tokens=False)
    text += detokenizer.push(tail) + detokenizer.finish()
    assert max(decoded) <= len(ids) + len(tail) - 1200, max(decoded)
    assert text == tokenizer.decode_output(ids + tail)


def test_a_byte_run_held_back_is_not_decoded_at_each_push(tmp_path, monkeypatch):
    """While the window ends in a byte-fallback token its text waits whatever the decode says,
    so the push does not decode (each push had decoded the whole run twice: a run of n tokens
    pushed one at a time cost n^2, and the server's count of tokens through a stop string
    pushes them so: 12,000 byte tokens took 27 s). The text is the same."""
    tokenizer = Tokenizer(write_chat_checkpoint(tmp_path, byte_fallback=True))
    ids = tokenizer.encode("a" + "🦄鯨∑" * 100 + " b", add_special_tokens=False)
    assert sum(i in tokenizer._byte_ids for i in ids) >= 900
    decodes = []
    decode = tokenizer._decode
    monkeypatch.setattr(tokenizer, "_decode", lambda ids, *rest: decodes.append(len(ids)) or decode(ids, *rest))
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.finish()
    assert text == tokenizer.decode(ids)
    assert len(decodes) <= 4 * sum(i not in tokenizer._byte_ids for i in ids) + 4, len(decodes)


def test_until_eos():
    assert until_eos([5, 6, 1, 7], [1]) == [5, 6]
    assert until_eos([5, 6], [1]) == [5, 6]


def test_stop_strings_across_pieces():
    stops = StopStringFilter(["END", "xy"])
    out = [stops.push(p) for p in ["abc E", "N", "D tail"]]
    assert "".join(out) == "abc " and stops.stopped
    stops = StopStringFilter(["END"])
    assert "".join([stops.push("abE"), stops.push("N"), stops.push("", final=True)]) == "abEN"
    assert not stops.stopped


def test_stop_strings_cut_where_the_text_would_however_it_arrives(checkpoint):
    """The cut is where text arriving character by character would stop (the stop string that
    ends first, the longer of two ending together), whatever the pieces; it had depended on
    them. A stop string whose characters arrive as byte tokens cuts exactly too."""
    stops, text = ["abc", "b", "cab", "ca"], "xxabcab"
    def stream(pieces):
        stop_filter = StopStringFilter(stops)
        return "".join(stop_filter.push(p) for p in pieces) + stop_filter.push("", final=True)
    one_by_one = stream(text)
    assert one_by_one == "xxa"  # "b" ends first ("abc", which starts before it, ends later)
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(len(text) - 1)))
        assert stream([text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]) == one_by_one
    tokenizer = Tokenizer(checkpoint)
    ids = tokenizer.encode(TEXTS[-1], add_special_tokens=False)  # 🦄 and 鯨 in byte tokens
    for chunk in (1, 2, 3):
        detokenizer, stop_filter = IncrementalDetokenizer(tokenizer), StopStringFilter(["鯨∑", "x"])
        out = "".join(stop_filter.push(detokenizer.push(ids[i:i + chunk])) for i in range(0, len(ids), chunk))
        out += stop_filter.push(detokenizer.finish(), final=True)
        assert out == "unseen, so byte by byte: 🦄" and stop_filter.stopped


def test_stop_strings_agree_with_a_search_of_the_whole_text():
    """However the text is cut into pieces, the filter cuts where a search of the whole text
    says: before the stop string that ends first (the longer of two ending together). (It
    looks for each stop string only from its length before each piece on.)"""
    rng = random.Random(1)
    for _ in range(500):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(1, 40)))
        stops = list({"".join(rng.choice("abc") for _ in range(rng.randrange(1, 6))) for _ in range(3)})
        found = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(len(text)))) if len(text) > 1 else []
        for include_stop in (False, True):  # (vLLM's include_stop_str_in_output: through the stop string)
            expected = text[:min(found)[1 - include_stop]] if found else text
            stop_filter = StopStringFilter(stops, include_stop)
            out = "".join(stop_filter.push(text[i:j]) for i, j in zip([0] + cuts, cuts + [len(text)]))
            out += stop_filter.push("", final=True)
            assert out == expected, (text, stops, cuts, include_stop)
            assert stop_filter.stopped == bool(found)
            if found:
                assert (stop_filter.stop_end, stop_filter.stop_string) == (min(found)[0], min(found)[2])


def test_llm_text_prompts_and_output_text(checkpoint):
    llm = ds.LLM(checkpoint)
    params = ds.SamplingParams(max_new_tokens=24, seed=5)
    by_text = llm.generate(["Hello world", "東京"], params)
    by_ids = llm.generate([llm.tokenizer.encode("Hello world"), llm.tokenizer.encode("東京")], params)
    # An array of texts is texts, as a list of them (it had been taken as one prompt of ids).
    assert [o.token_ids for o in llm.generate(np.array(["Hello world", "東京"]), params)] == \
        [o.token_ids for o in by_text]
    for a, b in zip(by_text, by_ids):
        assert a.token_ids == b.token_ids and a.prompt_token_ids == b.prompt_token_ids
        assert a.text == llm.tokenizer.decode_output(until_eos(a.token_ids, [1]))
    # An EOS ending the output is not part of its text.
    out = llm.generate("Hi", ds.SamplingParams(max_new_tokens=16, seed=0, seed_canvas=[7] * 4 + [1] + [7] * 11,
                                               pinned_positions=[4]))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 1
    assert out.text == llm.tokenizer.decode_output(out.token_ids[:-1])


def test_text_that_is_not_unicode_is_refused(checkpoint):
    """A lone surrogate (Python strings may hold one; UTF-8 cannot) is a ValueError naming the
    prompt, not the tokenizers library's TypeError; the LLM goes on."""
    llm = ds.LLM(checkpoint)
    with pytest.raises(ValueError, match=r"prompt 0: text is not valid Unicode: .* at character 1"):
        llm.generate(["a\ud800b"])
    assert llm.generate(["ab"], ds.SamplingParams(max_new_tokens=8, seed=0))[0].token_ids


@pytest.mark.parametrize("name, content", [("tokenizer.json", "{garbage"), ("tokenizer.json", "{}"),
                                           ("tokenizer_config.json", "{'a': 1}"), ("tokenizer_config.json", "[1]"),
                                           ("chat_template.jinja", b"\xff\xfe{{ x }}")])
def test_unreadable_tokenizer_files_name_the_file(tmp_path, name, content):
    path = write_chat_checkpoint(tmp_path / "m")
    with open(f"{path}/{name}", "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)
    with pytest.raises(ds.CheckpointError, match=re.escape(f"{path}/{name}")):
        Tokenizer.from_checkpoint(path)


def _edited_copy(checkpoint, tmp_path, **config_changes):
    """A copy of the checkpoint without chat_template.jinja, its tokenizer_config.json updated."""
    import json
    import shutil
    path = shutil.copytree(checkpoint, tmp_path / "m")
    own = (path / "chat_template.jinja").read_text() if (path / "chat_template.jinja").exists() else None
    (path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.setdefault("chat_template", own)
    config.update(config_changes)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_chat_templates_chosen_as_transformers_chooses(checkpoint, tmp_path):
    """The named templates of tokenizer_config.json and of additional_chat_templates/*.jinja:
    "tool_use" where tools are given, else "default"; files win over the config; an empty
    template renders "" and a template given as a dict by name is read (both had been "no
    chat template"; the tool_use template and the folder had not been read)."""
    path = _edited_copy(checkpoint, tmp_path, chat_template=[
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | tojson }}"}])
    conversation = CONVERSATIONS[0]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]

    def same(**kwargs):
        ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
        text = ours.apply_chat_template(conversation, **kwargs)
        assert text == theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True, **kwargs)
        return text

    assert same() == "D1" and same(tools=tools) == 'T[{"type": "function", "function": {"name": "f", "parameters": {}}}]'
    assert same(tools=[]) == "T[]" and same(chat_template="default", tools=tools) == "D1"
    (path / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    (path / "additional_chat_templates").mkdir()
    (path / "additional_chat_templates" / "rag.jinja").write_text("R{{ documents | length }}")
    assert same() == "JHello!" and same(chat_template="rag", documents=[{"title": "a", "text": "b"}]) == "R1"
    assert same(tools=tools) == "JHello!" and same(chat_template="tool_use") == "tool_use"  # the config's are gone
    (path / "chat_template.jinja").write_text("")
    assert same() == ""
    (path / "chat_template.jinja").unlink()
    assert same(chat_template="rag", documents=[]) == "R0"
    with pytest.raises(ValueError, match=r"several chat templates and none named 'default'.*\['rag'\]"):
        Tokenizer(path).apply_chat_template(conversation)


def test_chat_template_that_does_not_compile_fails_where_it_is_used(checkpoint, tmp_path):
    """The tokenizer loads and encodes (completions work); apply_chat_template names the fault."""
    path = _edited_copy(checkpoint, tmp_path, chat_template="{% for m in messages %}{{ m.content }")
    tokenizer = Tokenizer(path)
    assert tokenizer.encode("Hello") == AutoTokenizer.from_pretrained(path).encode("Hello")
    with pytest.raises(ChatTemplateError, match="the chat template does not compile"):
        tokenizer.apply_chat_template(CONVERSATIONS[0])


def test_chat_template_sees_plain_data_as_transformers_passes_it(checkpoint):
    """A Python object reaches the template as "<TypeName>" (its attributes had been readable),
    a dataclass message as a dict; namespace refuses underscore names; a Python error inside
    the template (a number added to a string) is a ChatTemplateError, as its own refusals are;
    tools and documents are lists of dicts."""
    import dataclasses

    class Secret:
        key = "S"

    @dataclasses.dataclass
    class Message:
        role: str
        content: str

    ours, theirs = Tokenizer(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    for template, kwargs in [("{{ o.key }}|{{ o }}", {"o": Secret()}), ("{{ d }}", {"d": {"k": (1, 2.5)}}),
                             ("{% set ns = namespace(x=1) %}{% set ns.x = 2 %}{{ ns.x }}{{ dict(a=1) }}", {})]:
        assert ours.apply_chat_template(CONVERSATIONS[0], chat_template=template, **kwargs) == \
            theirs.apply_chat_template(CONVERSATIONS[0], chat_template=template, tokenize=False, **kwargs)
    assert ours.apply_chat_template([Message("user", "Hello!")]) == ours.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(ChatTemplateError, match="may not store the underscore name '_x' on a namespace"):
        ours.apply_chat_template(CONVERSATIONS[0], chat_template="{% set ns = namespace(_x=1) %}")
    with pytest.raises(ChatTemplateError, match=r"the chat template failed: TypeError: can only concatenate str"):
        ours.apply_chat_template(CONVERSATIONS[0], chat_template="{{ 'a' + n }}", n=5)
    with pytest.raises(ChatTemplateError, match=r"tools\[0\] must be a JSON schema \(a dict\), got function \(a "
                                                r"Python function is not turned into its schema here"):
        ours.apply_chat_template(CONVERSATIONS[0], tools=[test_until_eos])
    with pytest.raises(ChatTemplateError, match=r"documents must be a list of dicts \(each a document\), got str"):
        ours.apply_chat_template(CONVERSATIONS[0], documents="text")


def test_continue_final_message_checked_as_transformers_checks_it(checkpoint):
    """The final message must appear in the text as given (a template that changes it cannot
    have the prompt end inside it: had ended wherever the tag was), and the template must read
    the field continued; a field's name continues that field."""
    ours, theirs = Tokenizer(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go", "reasoning": "th"}]
    for template in ("{{ messages[-1].content | upper }}", "{{ messages | length }}"):
        with pytest.raises(ValueError):
            theirs.apply_chat_template(conversation, chat_template=template, continue_final_message=True, tokenize=False)
        with pytest.raises(ChatTemplateError, match="continue_final_message: the chat template"):
            ours.apply_chat_template(conversation, chat_template=template, continue_final_message=True)
    template = "{% for m in messages %}<{{ m.reasoning_content }}|{{ m.content }}>{% endfor %}"
    for field in (True, "reasoning_content", "reasoning"):
        assert ours.apply_chat_template(conversation, chat_template=template, continue_final_message=field) == \
            theirs.apply_chat_template(conversation, chat_template=template, continue_final_message=field,
                                       tokenize=False)


def test_special_tokens_that_tokenizer_json_lacks_are_added(checkpoint, tmp_path):
    """Special tokens named in tokenizer_config.json (an eos_token, extra_special_tokens) and its
    added_tokens_decoder entries that tokenizer.json lacks are added after its vocabulary, as
    transformers adds them (they had been no tokens at all: the eos id None, the text split)."""
    path = _edited_copy(checkpoint, tmp_path, eos_token="<EOS_NEW>", extra_special_tokens=["<image>"],
                        added_tokens_decoder={"9000": {"content": "<tool>", "special": False}})
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert ours.vocab_size == len(theirs) and ours.eos_token_id == theirs.eos_token_id is not None
    text = "a<EOS_NEW> b<image><tool>c <eos>"
    for special in (True, False):
        assert ours.encode(text, add_special_tokens=special) == theirs.encode(text, add_special_tokens=special)
    ids = theirs.encode(text)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("keys", [("mask_token", "unk_token"), ("pad_token", "boi_token", "sep_token", "bos_token")])
def test_special_tokens_that_tokenizer_json_lacks_get_ids_in_transformers_order(checkpoint, tmp_path, keys):
    """The special tokens tokenizer.json lacks get their ids in transformers' order (bos, eos,
    unk, sep, pad, cls, mask, then a model's own "..._token" keys), whatever order
    tokenizer_config.json lists them in: save_pretrained sorts its keys (they had been given ids
    in the file's order, so "<mask>" took "<unk>"'s id)."""
    path = _edited_copy(checkpoint, tmp_path, **{key: f"<NEW_{key}>" for key in keys})
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    text = "x" + "".join(f"<NEW_{key}> y" for key in keys)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    for key in keys:
        assert ours.token_id(f"<NEW_{key}>") == theirs.convert_tokens_to_ids(f"<NEW_{key}>")


def _token(content, **flags):
    return {"__type": "AddedToken", "content": content, "lstrip": False, "rstrip": False, "special": True,
            "normalized": False, "single_word": False, **flags}


# Each names added tokens tokenizer.json already has (<mask> special with lstrip, <tool> and
# <eos2> plain with lstrip and rstrip, <x> plain with lstrip).
CONFIG_TOKENS = {
    "named as a string": {"mask_token": "<mask>", "eos_token": "<eos2>", "tool_token": "<tool>"},
    "named as an object": {"mask_token": _token("<mask>"), "tool_token": _token("<tool>")},
    "named in extra_special_tokens": {"extra_special_tokens": {"tool_token": "<tool>"}},
    "listed in extra_special_tokens": {"extra_special_tokens": ["<tool>", _token("<x>"), "<new>"]},
    "additional_special_tokens under an empty extra_special_tokens": {
        "extra_special_tokens": [], "additional_special_tokens": ["<tool>", "<new>"]},
    "added_tokens_decoder": {"added_tokens_decoder": {"401": _token("<tool>"),
                                                      "400": _token("<mask>", special=False)}},
    "named, not in added_tokens_decoder": {"added_tokens_decoder": {"400": _token("<mask>", lstrip=True)},
                                           "eos_token": "<eos2>", "tool_token": "<tool>"},
    # An unnamed one given as an AddedToken that is not special is added as plain text (it had
    # been made special, and dropped from decoded output); one named too is as named.
    "listed as an AddedToken that is not special": {"eos_token": "<new2>", "extra_special_tokens": [
        _token("<new2>", special=False), _token("<new3>", special=False), "<new>"]},
}


@pytest.mark.parametrize("config", CONFIG_TOKENS.values(), ids=CONFIG_TOKENS.keys())
def test_config_tokens_tokenizer_json_has_keep_what_transformers_keeps(tmp_path, config):
    """A special token tokenizer_config.json names by a string keeps the flags tokenizer.json gives
    it (an lstrip <mask> had lost its lstrip, and text around it encoded otherwise); an unnamed
    one tokenizer.json has as plain text stays text (it had been dropped from decoded output);
    additional_special_tokens count where extra_special_tokens is empty: as transformers."""
    from tokenizers import AddedToken
    from chat_checkpoint import train_tokenizer
    tokenizer = train_tokenizer()
    tokenizer.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    tokenizer.add_tokens([AddedToken("<tool>", lstrip=True, rstrip=True), AddedToken("<eos2>", lstrip=True, rstrip=True),
                          AddedToken("<x>", lstrip=True, normalized=False)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", **config}))
    ours, theirs = Tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.vocab_size == len(theirs)
    text = "a <mask> b <tool> c <eos2> d<x>e <new> f <new2> g<new3>"
    ids = theirs.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=False) == ids
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("changes, message", [
    ({"eos_token": 5}, "eos_token must be a string or an AddedToken object"),
    ({"extra_special_tokens": "oops"}, "extra_special_tokens must be a list of tokens or an object of named ones"),
    ({"chat_template": 5}, "chat_template must be a template"),
    ({"chat_template": [{"name": "default"}]}, r"chat_template\[0\] must be an object with a string 'name' and "
                                               "'template'"),
    ({"added_tokens_decoder": {"x": "<a>"}}, "added_tokens_decoder: 'x' is not a token id")])
def test_malformed_tokenizer_config_values_name_the_file(checkpoint, tmp_path, changes, message):
    path = _edited_copy(checkpoint, tmp_path, **changes)
    with pytest.raises(ds.CheckpointError, match=re.escape(str(path / "tokenizer_config.json")) + ": " + message):
        Tokenizer(path)


def test_tokenizer_json_that_fails_to_run_is_a_checkpoint_error(checkpoint, tmp_path):
    """A post-processor naming a token it does not list panics inside the tokenizers library on
    every encode (a BaseException that `except Exception` misses): a CheckpointError at load."""
    import json
    import shutil
    path = shutil.copytree(checkpoint, tmp_path / "m")
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<x>", "type_id": 0}},
                                                                      {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {}}
    (path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ds.CheckpointError, match=re.escape(str(path / "tokenizer.json")) + ": the tokenizer fails"):
        Tokenizer(path)


def test_clean_up_tokenization_spaces_as_transformers(tmp_path):
    """A WordPiece checkpoint with clean_up_tokenization_spaces: decoding drops the spaces before
    punctuation and contractions as transformers does (BPE checkpoints are left alone, as
    there), in whole decodes and in streams, however the tokens arrive."""
    path = write_clean_up_tokenizer(tmp_path)
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert ours.clean_up_tokenization_spaces
    rng = random.Random(0)
    words = CLEAN_UP_CORPUS.split() + ["a"]
    for _ in range(100):
        ids = ours.encode(" ".join(rng.choice(words) for _ in range(rng.randrange(1, 30))))
        text = theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids) == ours.decode_output(ids) == text
        detokenizer, pieces, done = IncrementalDetokenizer(ours), [], 0
        while done < len(ids):
            step = rng.randrange(1, 4)
            pieces.append(detokenizer.push(ids[done:done + step]))
            done += step
        assert "".join(pieces) + detokenizer.finish() == text
    assert ours.decode(ids, clean_up_tokenization_spaces=False) == \
        theirs.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_a_long_run_of_bytes_that_are_no_text_streams_as_it_comes(tmp_path):
    """A ByteLevel output with thousands of tokens that are each a byte no UTF-8 character takes
    (U+FFFD; a client can ask for them with allowed_token_ids): their text goes out as they
    come, up to the last few, and each push decodes a window of a few tokens. Held back, the
    window had grown by each, decoded whole at every push: 8,000 had taken 22 s."""
    tokenizer = Tokenizer(write_chat_checkpoint(tmp_path / "m"))
    theirs = AutoTokenizer.from_pretrained(tmp_path / "m")
    invalid = next(i for i in range(tokenizer.vocab_size)
                   if tokenizer.decode([i]) == "\ufffd" and tokenizer.decode([i] * 5) == "\ufffd" * 5)
    ids = tokenizer.encode("ok \u00e9", add_special_tokens=False) + [invalid] * 2000 + \
        tokenizer.encode(" \u20ac", add_special_tokens=False)
    decoded = []
    decode_output = tokenizer.decode_output
    tokenizer.decode_output = lambda some, **kw: decoded.append(len(some)) or decode_output(some, **kw)
    detokenizer, pieces = IncrementalDetokenizer(tokenizer), []
    for i in ids:
        pieces.append(detokenizer.push([i]))
        if len(pieces) == 1000:
            assert "".join(pieces).count("\ufffd") >= 990  # the run's text going out
    assert "".join(pieces) + detokenizer.finish() == theirs.decode(ids)
    assert sum(decoded) < 20 * len(ids)


def test_tokens_with_an_empty_vocabulary_entry_settle_no_character(tmp_path):
    """A ByteLevel vocabulary with an empty entry: its tokens have no byte, so three of them
    after a character's first bytes settle nothing (the stream had let those bytes out as a
    U+FFFD, and the character never came)."""
    import json
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    empty = vocab[""] = len(vocab)
    library = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    library.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    library.decoder = decoders.ByteLevel()
    library.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    tokenizer = Tokenizer(tmp_path)
    x, *emoji = tokenizer.encode("x\U0001F600", add_special_tokens=False)
    ids = [x, *emoji[:2], empty, empty, empty, *emoji[2:]]
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push([i]) for i in ids] + [detokenizer.finish()]
    assert "".join(pieces) == tokenizer.decode_output(ids) == AutoTokenizer.from_pretrained(tmp_path).decode(ids)
    assert "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize("call, name", [
    (lambda t: t.encode("hi", add_special_tokens=1), "add_special_tokens"),
    (lambda t: t.encode("hi" * 100_000, add_special_tokens=None), "add_special_tokens"),
    (lambda t: t.decode([5, 6], skip_special_tokens=0), "skip_special_tokens"),
    (lambda t: t.decode_output([5, 6], skip_special_tokens=None), "skip_special_tokens"),
    (lambda t: t.decode([5, 6], clean_up_tokenization_spaces="yes"), "clean_up_tokenization_spaces"),
])
def test_a_flag_of_another_type_is_named_not_blamed_on_the_checkpoint(tmp_path, call, name):
    """encode's and decode's flags are True or False: another type is a ValueError naming the
    argument (the library's TypeError had been a CheckpointError naming tokenizer.json)."""
    tokenizer = Tokenizer(write_chat_checkpoint(tmp_path / "m"))
    with pytest.raises(ValueError, match=f"^{name} must be True or False, got "):
        call(tokenizer)


def test_cleaned_positions_say_where_each_cleaned_character_comes_from():
    """cleaned_positions makes clean_up_tokenization's replacements, in its order, keeping each
    character's place in the text before them."""
    from diffuserve.tokenizer import clean_up_tokenization, cleaned_positions
    rng = random.Random(0)
    alphabet = [" ", ".", "?", "!", ",", "'", "n", "t", "m", "s", "v", "e", "r", "a"]
    for _ in range(20000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(15)))
        places = cleaned_positions(text)
        assert "".join(text[k] for k in places) == clean_up_tokenization(text) and places == sorted(set(places))
    assert cleaned_positions("do n't ' x ' .") == [0, 1, 3, 4, 5, 7, 9, 10, 11, 13]  # "don't'x '."


def test_clean_up_asked_of_a_bpe_tokenizer_leaves_its_text_as_transformers(tmp_path):
    """decode(..., clean_up_tokenization_spaces=True) on a BPE checkpoint leaves the text alone
    as transformers does (the clean-up would drop real spaces before punctuation; it had been
    applied where the call asked for it), unless the config forces it for BPE."""
    import json
    path = write_chat_checkpoint(tmp_path / "m", byte_fallback=True)
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    ids = theirs.encode("Hello , world ! I 'm here .", add_special_tokens=False)
    text = theirs.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=True)
    assert ours.decode(ids, clean_up_tokenization_spaces=True) == text == "Hello , world ! I 'm here ."
    config = json.loads(open(f"{path}/tokenizer_config.json").read())
    config["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
    open(f"{path}/tokenizer_config.json", "w").write(json.dumps(config))
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    forced = theirs.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=True)
    assert ours.decode(ids, clean_up_tokenization_spaces=True) == forced == "Hello, world! I'm here."


def test_gemma_tokenizer_class_names_its_default_special_tokens(tmp_path):
    """tokenizer_class GemmaTokenizer names <unk>, <bos>, <eos>, <pad> and <mask> where the config
    does not, and transformers adds the ones tokenizer.json lacks (this one has no <mask>)."""
    import json
    path = write_chat_checkpoint(tmp_path / "m", byte_fallback=True)
    config = json.loads(open(f"{path}/tokenizer_config.json").read())
    config["tokenizer_class"] = "GemmaTokenizer"
    open(f"{path}/tokenizer_config.json", "w").write(json.dumps(config))
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert ours.vocab_size == len(theirs) and ours.token_id("<mask>") is not None
    assert ours.special_tokens == {key: str(value) for key, value in theirs.special_tokens_map.items()}
    for text in ["a<mask>b <unk>", *TEXTS]:
        assert ours.encode(text) == theirs.encode(text)


# (tokenizer_config.json's special tokens, special_tokens_map.json's): <new1> and <new2> are
# not in tokenizer.json; a special one is added, and matched whole in text.
SPECIAL_TOKENS_MAPS = {
    "map names bos, eos and extra ones": ({"extra_special_tokens": ["<start_of_turn>"]}, {
        "bos_token": {"content": "<bos>", "special": False}, "eos_token": "<eos>",
        "extra_special_tokens": ["<new1>", "<start_of_turn>"]}),
    "map's additional where the config lists some": ({"additional_special_tokens": ["<new1>"]},
                                                      {"eos_token": "<eos>", "additional_special_tokens": ["<new2>"]}),
    "map's additional where the config lists none": ({"additional_special_tokens": []},
                                                     {"additional_special_tokens": ["<new2>"]}),
    "map's additional alone": ({}, {"bos_token": "<bos>", "additional_special_tokens": ["<new1>", "<new2>"]}),
    "map's named tokens win": ({"eos_token": "<pad>"}, {"eos_token": "<eos>"}),
    # A model's own named tokens: the map's get their ids first, the config's values win, and an
    # extra_special_tokens object stays beside the map's list (the map's had come last, won, and
    # replaced the object); a standard name in that object takes its standard place.
    "map's own named tokens": ({"boi_token": "<new1>"}, {"image_token": "<new2>", "boi_token": "<eos>"}),
    "config's extra object, map's list": ({"extra_special_tokens": {"image_token": "<new1>"}},
                                          {"extra_special_tokens": ["<new2>"]}),
    "config's extra object, map's additional": ({"extra_special_tokens": {"image_token": "<new2>"}},
                                                {"additional_special_tokens": ["<new1>"]}),
    "extra object names a standard token": ({"cls_token": "<new1>", "extra_special_tokens": {"bos_token": "<new2>"}},
                                            {}),
    # An own token the config gives as an AddedToken is not set apart as a string is: it stays
    # among the settings, in its place, and the map's wins over it.
    "config's own AddedToken, map's string": ({"boi_token": _token("<new1>")}, {"boi_token": "<new2>"}),
    "config's own AddedToken first": ({"audio_token": _token("<new1>")}, {"boi_token": "<new2>"}),
    "config's model_specific_special_tokens": ({"model_specific_special_tokens": {"image_token": "<new2>"}}, {}),
}


@pytest.mark.parametrize("config, tokens_map", SPECIAL_TOKENS_MAPS.values(), ids=SPECIAL_TOKENS_MAPS.keys())
def test_special_tokens_map_read_as_transformers_reads_it(tmp_path, config, tokens_map):
    """An older checkpoint keeps its special tokens in special_tokens_map.json: where
    tokenizer_config.json has no added_tokens_decoder, transformers merges them in (they had been
    missing: the template's bos_token empty, no eos id, extra tokens split into characters)."""
    path = _edited_checkpoint(tmp_path, config, drop=("bos_token", "eos_token", "pad_token", "added_tokens_decoder"))
    (tmp_path / "m" / "special_tokens_map.json").write_text(json.dumps(tokens_map))
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.special_tokens == {key: str(value) for key, value in theirs.special_tokens_map.items()}
    conversation = CONVERSATIONS[1]
    assert ours.apply_chat_template(conversation) == \
        theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    for text in ["a<new1>b<new2><start_of_turn> <eos>", *TEXTS]:
        assert ours.encode(text) == theirs.encode(text), text
    ids = theirs.encode("a<new1>b<new2><eos>")
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


def test_vocabulary_with_a_gap_in_its_ids_decodes_them_all(tmp_path):
    """A vocabulary whose ids leave a gap: the tokenizer's size is one past its highest id, not
    its count of entries (a byte token past that count had been refused by decode and dropped
    from a model's output)."""
    def shift_byte_tokens(data):
        vocab = data["model"]["vocab"]
        gap_from = min(vocab[f"<0x{b:02X}>"] for b in range(256))
        for token, i in vocab.items():
            if i >= gap_from:
                vocab[token] = i + 10
        for token in data["added_tokens"]:
            if token["id"] >= gap_from:
                token["id"] += 10
    path = _edited_checkpoint(tmp_path, tokenizer_json_changes=shift_byte_tokens, drop=("added_tokens_decoder",))
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    highest = max(theirs.get_vocab().values())
    assert ours.vocab_size == highest + 1
    ids = [highest, *theirs.encode("ok \u00e9\u4e16", add_special_tokens=False), ours.token_id("<0xFF>")]
    expected = theirs.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == ours.decode_output(ids) == expected
    detokenizer = IncrementalDetokenizer(ours)
    assert detokenizer.push(ids) + detokenizer.finish() == expected
    # A gap's id has no text: between two byte tokens it does not end their run, whose invalid
    # byte makes the whole run U+FFFDs (its first byte's "A" had gone out before it).
    gap = highest - 1
    while gap in theirs.get_vocab().values():
        gap -= 1
    ids = [ours.token_id("<0x41>"), gap, ours.token_id("<0x80>")]
    detokenizer = IncrementalDetokenizer(ours)
    pieces = [detokenizer.push([i]) for i in ids] + [detokenizer.finish()]
    assert "".join(pieces) == theirs.decode(ids, skip_special_tokens=True) == "\ufffd\ufffd"


def _edited_checkpoint(tmp_path, config_changes=(), tokenizer_json_changes=None, drop=()):
    """A byte-fallback chat checkpoint whose tokenizer_config.json has `config_changes` set (and
    the keys in `drop` removed), and whose tokenizer.json `tokenizer_json_changes(dict)` edits."""
    import json
    path = write_chat_checkpoint(tmp_path / "m", byte_fallback=True)
    config = json.loads(open(f"{path}/tokenizer_config.json").read())
    config.update(dict(config_changes))
    for key in drop:
        config.pop(key, None)
    open(f"{path}/tokenizer_config.json", "w").write(json.dumps(config))
    if tokenizer_json_changes:
        data = json.loads(open(f"{path}/tokenizer.json").read())
        tokenizer_json_changes(data)
        open(f"{path}/tokenizer.json", "w").write(json.dumps(data))
    return path


def _truncate_and_pad(data):
    data["truncation"] = {"direction": "Right", "max_length": 5, "strategy": "LongestFirst", "stride": 0}
    data["padding"] = {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<pad>"}


def _end_of_turn_not_special(data):
    for token in data["added_tokens"]:
        if token["content"] == "<end_of_turn>":
            token["special"] = False


@pytest.mark.parametrize("config_changes, tokenizer_json_changes, drop", [
    # tokenizer.json's saved truncation and padding: transformers' encode applies neither (every
    # prompt had been cut to 5 tokens, short ones padded to 8).
    ((), _truncate_and_pad, ()),
    # transformers 4's name for the unnamed special tokens (had been ignored: their text split into bytes).
    ({"additional_special_tokens": ["<tool_call>", "</tool_call>"]}, None, ()),
    # No tokenizer_class: AutoTokenizer takes the model type's, Gemma's, with its <unk> and <mask>.
    ((), None, ("tokenizer_class",)),
    # Special in added_tokens_decoder, not in tokenizer.json: special (its text had stayed in decodes).
    ({"added_tokens_decoder": {"4": {"content": "<end_of_turn>", "special": True, "lstrip": False, "rstrip": False,
                                     "normalized": False, "single_word": False}}}, _end_of_turn_not_special, ()),
    # split_special_tokens: special tokens in text are text (had been matched as the tokens).
    ({"split_special_tokens": True}, None, ()),
], ids=["truncation_padding", "additional_special_tokens", "no_tokenizer_class", "added_tokens_decoder_special",
        "split_special_tokens"])
def test_tokenizer_settings_read_as_transformers_reads_them(tmp_path, config_changes, tokenizer_json_changes, drop):
    path = _edited_checkpoint(tmp_path, config_changes, tokenizer_json_changes, drop)
    ours, theirs = Tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert ours.vocab_size == len(theirs)
    # Copies too, as multiprocessing hands them to workers (split_special_tokens had been lost).
    copies = [pickle.loads(pickle.dumps(ours)), copy.deepcopy(ours)]
    for text in ["x", "Hi <eos> a<tool_call>b</tool_call> <mask>", "Hi<end_of_turn>there", *TEXTS]:
        ids = theirs.encode(text)
        assert [t.encode(text) for t in [ours, *copies]] == [ids] * 3, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    conversation = CONVERSATIONS[1]
    assert ours.encode(ours.apply_chat_template(conversation), add_special_tokens=False) == \
        theirs.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True, return_dict=False)


@pytest.mark.parametrize("file,edit,message", [
    # The tokenizers library panics (a BaseException, which had escaped LLM()) on this one.
    ("tokenizer.json", lambda t: json.dumps({**json.loads(t), "normalizer": {
        "type": "Precompiled", "precompiled_charsmap": "AAAA"}}), "not a tokenizer the tokenizers library reads"),
    # Nested past Python's stack (a bare RecursionError, naming no file).
    ("tokenizer_config.json", lambda t: t.rstrip()[:-1] + ', "deep": ' + "[" * 5000 + "]" * 5000 + "}",
     "not a readable JSON file"),
    # A class name that is no string (a bare TypeError: unhashable type).
    ("tokenizer_config.json", lambda t: json.dumps({**json.loads(t), "tokenizer_class": {"a": 1}}),
     "tokenizer_class must be a class name"),
])
def test_malformed_tokenizer_files_are_checkpoint_errors(tmp_path, file, edit, message):
    path = write_chat_checkpoint(tmp_path / "m")
    text = open(f"{path}/{file}").read()
    open(f"{path}/{file}", "w").write(edit(text))
    with pytest.raises(ds.CheckpointError, match=message):
        Tokenizer(path)


def test_tojsons_count_of_its_output_is_its_length():
    """The chat template's tojson counts what it will write from its pieces (render_budget), so
    that a request's deeply nested data is refused before gigabytes are written: the count is the
    written length, whatever the indent and separators, or past it (non-ASCII, counted escaped)."""
    from diffuserve.chat_template import _json_chars

    rng = random.Random(3)

    def value(depth):
        kind = rng.randrange(6 if depth < 5 else 3)
        return [lambda: rng.randrange(-10**6, 10**6), lambda: "ab\"\\é\n"[:rng.randrange(7)], lambda: None,
                lambda: [value(depth + 1) for _ in range(rng.randrange(4))],
                lambda: {f"k{i}": value(depth + 1) for i in range(rng.randrange(4))}, lambda: rng.random()][kind]()
    for _ in range(300):
        x = value(0)
        for indent, separators in ((None, None), (2, None), (0, None), (4, (",", ": ")), ("\t", None),
                                   (None, (",", ":"))):
            written = len(json.dumps(x, ensure_ascii=False, indent=indent, separators=separators))
            width = len(indent) if isinstance(indent, str) else indent
            item, key = separators or ("," if indent is not None else ", ", ": ")
            counted = _json_chars(x, 0, width, len(item), len(key))
            assert written <= counted <= written + 5 * json.dumps(x).count("\\u"), (x, indent)
