from workers.model.loader import ModelSource
from workers.model.tokenizer import IncrementalDetokenizer, Tokenizer


def test_streaming_never_splits_multibyte_characters(smollm2_tokenizer_dir):
    tok = Tokenizer(ModelSource(smollm2_tokenizer_dir))
    text = "Café — naïve 日本語 🐝🌊 done."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_chat_template_wraps_one_user_message(smollm2_tokenizer_dir):
    tok = Tokenizer(ModelSource(smollm2_tokenizer_dir))
    ids = tok.encode_chat("What is 2+2?")
    text = tok.hf.decode(ids)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
