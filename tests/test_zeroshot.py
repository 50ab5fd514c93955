"""Zero-shot last-word accuracy: example building, scoring, and the 4-process eval."""

import math

import pytest
import torch

from megatron_edgc.training import zeroshot


class CharTokenizer:
    """One token per character (id = code point): token counts are character counts."""

    eod = 0

    def tokenize(self, text):
        return [ord(c) for c in text]

    def detokenize(self, ids):
        return "".join(chr(i) for i in ids)


TEXT_A = ("It was the best of times, it was the worst of times.\n"
          "We had everything before us; we had nothing before us\n"
          "KING HENRY. Go away, you rogue? Be off!\n"
          "Goodbye.\nAnd yet nevertheless.  gone.")
TEXT_B = "Short text. Tiny."
TEXT_C = "Now is the winter of our discontent made glorious summer by this sun of York"


def decoded(examples, tok):
    return [(tok.detokenize(c), tok.detokenize(t)) for c, t in examples]


def test_examples_are_the_sentence_final_words_with_their_contexts():
    tok = CharTokenizer()
    got = decoded(zeroshot.build_last_word_examples(tok, [TEXT_A, TEXT_B, TEXT_C], 10, 128),
                  tok)
    # Skipped: "us" (2 letters), "HENRY" (capitals), "Goodbye" (no space before it),
    # "nevertheless" (13 tokens > 8), "gone" (two spaces before it), TEXT_B's words
    # (contexts of 5 and 11 < 16 tokens). Round-robin over the texts: A, C, A, A.
    assert [t for _, t in got] == [" times", " York", " rogue", " off"]
    assert got[0][0] == "It was the best of times, it was the worst of"
    assert got[1][0] == TEXT_C[: -len(" York")]
    # The context ends right before the word, which ends a sentence or a line.
    for (context, target), text in zip(got, [TEXT_A, TEXT_C, TEXT_A, TEXT_A]):
        end = text.index(context + target) + len(context + target)
        assert end == len(text) or text[end] in ".!?;\n"
    # n_examples caps the count, keeping the round-robin order.
    first2 = zeroshot.build_last_word_examples(tok, [TEXT_A, TEXT_B, TEXT_C], 2, 128)
    assert [tok.detokenize(t) for _, t in first2] == [" times", " York"]
    assert zeroshot.build_last_word_examples(tok, [TEXT_B], 10, 128) == []
    # min_word_chars: "us" becomes a target when 2-letter words are allowed.
    with2 = decoded(zeroshot.build_last_word_examples(tok, [TEXT_A], 10, 128, min_word_chars=2),
                    tok)
    assert [t for _, t in with2] == [" times", " us", " us", " rogue", " off"]


def test_context_is_cut_to_the_sequence_length():
    tok = CharTokenizer()
    for seq in (24, 40, 64):
        examples = zeroshot.build_last_word_examples(tok, [TEXT_A, TEXT_C], 10, seq)
        for context, target in examples:
            assert len(context) + len(target) <= seq
            assert len(context) >= zeroshot.MIN_CONTEXT_TOKENS
            assert len(target) <= zeroshot.MAX_TARGET_TOKENS
        times = decoded(examples, tok)[0]
        assert times == ("It was the best of times, it was the worst of"[-(seq - 6):], " times")


def test_gpt2_bpe_context_and_target_tokenize_like_the_whole_text():
    """On real Shakespeare with GPT-2's BPE: context + target are the tokens of the text
    itself (so tokenizing them apart changes nothing), and the windowed tokenization of a
    long prefix equals the tail of the whole prefix's tokens."""
    from megatron_edgc.training import data
    from megatron_edgc.training.tokenizer import GPT2BPETokenizer

    tok = GPT2BPETokenizer()
    texts = [d["text"] for d in data.corpus_documents()[:3]]
    seq = 24  # short: the 16 x budget window is used for most words of a 4000-char text
    examples = zeroshot.build_last_word_examples(tok, texts, 10 ** 6, seq)
    assert len(examples) > 100
    windowed = 0
    for text in texts:
        for m in zeroshot._SENTENCE_FINAL.finditer(text):
            prefix = text[: m.start() - 1]
            target = tok.tokenize(" " + m.group(1))
            if len(target) > zeroshot.MAX_TARGET_TOKENS:
                continue
            budget = seq - len(target)
            whole = tok.tokenize(prefix)
            assert zeroshot._context_tokens(tok, prefix, budget) == whole[-budget:]
            assert tok.tokenize(prefix + " " + m.group(1)) == whole + target
            windowed += len(prefix) > 16 * budget
    assert windowed > 100


def test_score_exact_match_under_teacher_forcing():
    V, S = 6, 8
    examples = [([1, 2, 3], [4]),        # predicts 4 at position 2: right
                ([1, 2], [3, 4]),        # first token right, second wrong
                ([4, 4, 4], [2, 1]),     # both tokens right
                None]                    # an empty slot
    batch = zeroshot.pack(examples, S, pad_id=0)
    assert batch["tokens"][0].tolist() == [1, 2, 3, 4, 0, 0, 0, 0]
    assert batch["tokens"][2].tolist() == [4, 4, 4, 2, 1, 0, 0, 0]
    assert batch["target_pos"][1, :2].tolist() == [1, 2]
    assert batch["target_ids"][1].tolist() == [3, 4] + [-1] * 6
    logits = torch.zeros(4, S, V)
    logits[0, 2, 4] = 5.0
    logits[1, 1, 3] = 5.0
    logits[1, 2, 0] = 5.0   # the second token of example 1 is wrong
    logits[2, 2, 2] = 5.0
    logits[2, 3, 1] = 5.0
    logits[0, 3, 5] = 9.0   # after the word: irrelevant
    s = zeroshot.score(logits, batch["target_pos"], batch["target_ids"])
    assert s.correct.tolist() == [True, False, True, False]
    assert s.valid.tolist() == [True, True, True, False]
    assert s.correct.sum().item() / s.valid.sum().item() == pytest.approx(2 / 3)
    big, small = math.log(math.exp(5) + V - 1), math.log(math.exp(5) + V - 1) - 5
    # -log p: a 5-logit hit costs `small`; a 0-logit target beside a 5-logit costs `big`.
    assert s.nll.tolist() == pytest.approx([small, small + big, 2 * small, 0.0])

    # Padded vocabulary: a larger logit at an id >= vocab_size is not a prediction.
    logits[0, 2, 5] = 7.0
    assert zeroshot.score(logits, batch["target_pos"], batch["target_ids"]).correct[0].item() \
        is False
    sliced = zeroshot.score(logits, batch["target_pos"], batch["target_ids"], vocab_size=5)
    assert sliced.correct.tolist() == [True, False, True, False]

    # Tensor parallel: each rank holds a vocabulary shard; gathering the target rows of
    # the shards gives the unsharded result.
    shard0, shard1 = logits[..., :3], logits[..., 3:]
    rows1 = shard1[torch.arange(4).unsqueeze(1), batch["target_pos"]]
    tp = zeroshot.score(shard0, batch["target_pos"], batch["target_ids"], vocab_size=5,
                        gather=lambda rows0: torch.cat([rows0, rows1], dim=-1))
    assert tp.correct.tolist() == sliced.correct.tolist()
    assert torch.allclose(tp.nll, sliced.nll)


def test_stream_splits_examples_over_dp_ranks_once_each():
    examples = [([7] * 16, [100 + i]) for i in range(11)]
    seen = []
    for dp in range(2):
        stream = zeroshot.LastWordStream(examples, 20, 0, micro_batch_size=2,
                                         num_microbatches=2, dp_rank=dp, dp_size=2)
        assert stream.num_calls == 2  # 8 examples per call
        for call in range(stream.num_calls):
            mbs = list(stream.micro_batches(call))
            assert len(mbs) == 2 and all(mb["tokens"].shape == (2, 20) for mb in mbs)
            for mb in mbs:
                seen += [t for t in mb["target_ids"][:, 0].tolist() if t >= 0]
    assert sorted(seen) == [100 + i for i in range(11)]


def test_summary_line():
    from megatron_edgc.training.loop import format_summary

    s = {"layout": "TP1·PP2·DP2", "iterations": 40, "first_loss": 9.0, "final_loss": 6.7,
         "val_loss": 6.7, "val_ppl": 812.4, "ms_per_iter": 300.0, "tokens_per_s": 6000.0,
         "grad_sync_ms": 50.0, "wall_s": 20.0, "last_word_acc": 0.123, "last_word_n": 200}
    assert "| val ppl 812.40 | last-word acc 12.3 % (n=200) |" in format_summary(s)
    s["last_word_n"] = s["last_word_acc"] = None
    assert "last-word" not in format_summary(s)


def test_last_word_eval_tp2_pp2_equals_tp1_pp2_dp2(small_model_argv, tmp_path):
    """Forward-only through the real schedule: with lr 0 both layouts hold the same
    (initial) weights, so the TP-gathered logits (TP2) and the DP-split examples (DP2)
    must give the same accuracy and word log-likelihood."""
    from distributed import LAYOUTS, read_jsonl, run_job

    out = {}
    for layout in ("tp2-pp2-dp1", "tp1-pp2-dp2"):
        metrics = str(tmp_path / f"{layout}.jsonl")
        results = run_job(small_model_argv + LAYOUTS[layout] + [
            "--train-iters", "10", "--lr", "0", "--min-lr", "0", "--eval-iters", "1",
            "--last-word-examples", "32", "--metrics-file", metrics],
            str(tmp_path / layout))
        last = read_jsonl(metrics)[-1]
        assert last["iteration"] == 10
        assert last["last_word_n"] == 32
        assert 0.0 <= last["last_word_acc"] <= 1.0
        # -log p of a word is at least that of its first token; near ln(2048) = 7.6 at init.
        assert 6.0 < last["last_word_nll"] < 20.0
        for r in results:  # every last-stage rank holds the (DP-reduced) figures
            s = r["summary"]
            if r["pp"] == 1:
                assert (s["last_word_acc"], s["last_word_n"]) == (last["last_word_acc"], 32)
            else:
                assert s["last_word_n"] is None
        out[layout] = (last, results)
    (a, ra), (b, rb) = out["tp2-pp2-dp1"], out["tp1-pp2-dp2"]
    # Premise: the same weights (TP2's vocabulary shards are TP1's embedding, split).
    emb = [k for k in ra[0]["params"] if "word_embeddings" in k][0]
    tp2 = [r["params"][emb] for r in sorted(ra, key=lambda r: r["tp"]) if r["pp"] == 0]
    tp1 = [r["params"][emb] for r in rb if r["pp"] == 0 and r["dp"] == 0][0]
    assert torch.equal(torch.cat(tp2), tp1)
    assert a["last_word_acc"] == b["last_word_acc"]
    assert a["last_word_nll"] == pytest.approx(b["last_word_nll"], rel=1e-5)
