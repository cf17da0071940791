"""A tiny random-weight checkpoint with a real tokenizer: a BPE trained here (no download),
byte-level or, as Gemma's, with byte-fallback tokens; Gemma-style special tokens and chat
template, in the files transformers writes."""
import json
import os

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from diffuserve.random_checkpoint import write_random_checkpoint

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]  # ids 0..4: pad, eos, bos as in
                                                                                  # the model config
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if enable_thinking %}<start_of_turn>system\nThink first.<end_of_turn>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{% if role not in ['system', 'user', 'model'] %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Block diffusion refines a whole canvas at once.",
    "Hello world! How are you today? I am a tiny language model with random weights.",
    "日本語のテキストも少し入れます。東京は大きな都市です。中文也可以。你好世界。",
    "Emoji: 😀 🎉 🚀 👍🏽 ❤️ and accents: café, naïve, Zürich, São Paulo.",
] * 20
MODEL_CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=32, global_head_dim=32, num_experts=4, top_k_experts=2,
                    moe_intermediate_size=32, sliding_window=32)


def train_tokenizer(vocab_size: int = 400, byte_fallback: bool = False) -> Tokenizer:
    """A byte-level BPE (GPT-2's scheme), or with byte_fallback one like Gemma's: spaces as
    "▁", and a character outside the vocabulary as its UTF-8 bytes, tokens <0x00>..<0xFF>."""
    tokenizer = Tokenizer(models.BPE())
    if byte_fallback:
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
        trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=SPECIAL_TOKENS, show_progress=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    if byte_fallback:  # the trainer cannot add the byte tokens to the model's vocabulary: edit its JSON
        spec = json.loads(tokenizer.to_str())
        vocab = spec["model"]["vocab"]
        vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
        spec["model"]["byte_fallback"] = True
        tokenizer = Tokenizer.from_str(json.dumps(spec))
        tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                             special_tokens=[("<bos>", 2)])
    return tokenizer


def write_chat_checkpoint(path, canvas_length: int = 16, template_file: bool = False,
                          byte_fallback: bool = False) -> str:
    """The checkpoint directory; the chat template goes in tokenizer_config.json, or in
    chat_template.jinja when template_file is set; byte_fallback: a Gemma-style tokenizer."""
    write_random_checkpoint(path, canvas_length=canvas_length, **MODEL_CONFIG)
    train_tokenizer(byte_fallback=byte_fallback).save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "model_max_length": 4096}
    if template_file:
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(CHAT_TEMPLATE)
    else:
        config["chat_template"] = CHAT_TEMPLATE
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return str(path)


CLEAN_UP_CORPUS = "hello , world . don't you ' re fine ? yes ! we 've it 's i 'm n't"


def write_clean_up_tokenizer(path) -> str:
    """A WordPiece tokenizer whose config asks decoding to clean up spaces (BERT's kind), trained
    on CLEAN_UP_CORPUS: its tokenizer.json and tokenizer_config.json in `path`."""
    os.makedirs(path, exist_ok=True)
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator([CLEAN_UP_CORPUS] * 10, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]"], show_progress=False))
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"clean_up_tokenization_spaces": True, "unk_token": "[UNK]"}, f)
    return str(path)
