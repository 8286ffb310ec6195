from workers.model.loader import ModelSource
from workers.model.tokenizer import IncrementalDetokenizer, TextStream, Tokenizer


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


def test_a_stop_completed_by_a_token_not_yet_cut_is_never_shown(smollm2_tokenizer_dir):
    """A prefill's first token reaches the stream before a decode worker has matched it
    against the stops (no cut text): the text stops short of any stop it completes, and the
    engine's cut, when it comes, finds nothing of the stop shown."""
    tok = Tokenizer(ModelSource(smollm2_tokenizer_dir))
    ids = tok.encode(" Paris is lovely.")
    first = tok.decode(ids[:1])
    for stop in (first[-1], first.strip(), first[1:3], " is", "."):
        text = tok.decode(ids)
        cut = text[: text.find(stop)]
        s = TextStream(tok, (stop,))
        shown = s.push(ids[:1], None, False)  # the router's early event
        assert stop not in shown and cut.startswith(shown), (stop, shown)
        shown += s.push(ids[1:], cut, True)  # the decode worker's, cut
        assert shown == cut, stop


def test_output_that_never_completes_a_character_is_let_out_with_a_bounded_window(
    smollm2_tokenizer_dir,
):
    """A model emitting lone continuation bytes never completes a character: the text is let
    out after MAX_HELD_TOKENS tokens, and no push re-decodes more than twice that many (the
    tokens held, after the previous delta's)."""
    from workers.model.tokenizer import MAX_HELD_TOKENS

    tok = Tokenizer(ModelSource(smollm2_tokenizer_dir))
    byte = tok.hf.convert_tokens_to_ids("\u0122")  # the byte-level token of byte 0x80
    assert tok.decode([byte]) == "\ufffd"
    windows = []
    decode = tok.decode
    tok.decode = lambda ids: windows.append(len(ids)) or decode(ids)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([byte]) for _ in range(10 * MAX_HELD_TOKENS)]
    assert max(windows) <= 2 * MAX_HELD_TOKENS
    assert "".join(deltas) and deltas[: MAX_HELD_TOKENS - 1] == [""] * (MAX_HELD_TOKENS - 1)
    assert sum(len(d) > 0 for d in deltas) >= 9  # let out once every window, not held for ever
