#!/usr/bin/env python3
"""Tests of odyssey-prepare (odyssey_client/prepare.py) on a tiny BPE tokenizer trained offline
(tests/tiny_hf.py): text documents, chat conversations with the loss only on assistant turns,
the bin stream, --max-tokens/--overflow, the vocab check and the errors, and the console
entry point (`python -m odyssey_client.prepare`).

Run: python client/python/tests/test_prepare.py  (like test_unit.py, it generates the stubs into
a scratch copy of the package)."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

# Tokenizers only: keep transformers from importing torch (seconds of start-up), as the
# odyssey-prepare command does.
os.environ.setdefault("USE_TORCH", "0")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tiny_hf  # noqa: E402
from test_unit import oc  # noqa: E402  (the scratch copy of the package, with stubs)

from odyssey_client import prepare as P  # noqa: E402

CHAT = {"messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello, it is a pleasure!"},
]}
TEXT = {"text": "In the beginning God created the heaven and the earth."}


class PrepareTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="odyssey_prepare_test_")
        cls.tok_dir = os.path.join(cls.dir, "tok")
        cls.tok = tiny_hf.make_tokenizer(cls.tok_dir)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def write(self, name, rows, raw_lines=()):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            for line in raw_lines:
                f.write(line + "\n")
        return path

    def run_prepare(self, rows, fmt="jsonl", raw_lines=(), **kw):
        src = self.write("in.jsonl", rows, raw_lines)
        out = os.path.join(self.dir, "out." + fmt)
        if os.path.exists(out):
            os.unlink(out)
        stats = P.prepare(self.tok, src, out, fmt=fmt, **kw)
        return stats, out

    def read_jsonl(self, path):
        with open(path) as f:
            return [json.loads(line) for line in f]

    def test_text_is_the_tokenizers_ids_plus_eos_every_token_a_target(self):
        stats, out = self.run_prepare([TEXT])
        [row] = self.read_jsonl(out)
        want = self.tok(TEXT["text"])["input_ids"] + [self.tok.eos_token_id]
        self.assertEqual(row, {"tokens": want})  # no loss_mask: the engine's default, all ones
        self.assertEqual((stats.documents, stats.tokens, stats.targets), (1, len(want), len(want) - 1))
        _, out = self.run_prepare([TEXT], add_eos=False)
        self.assertEqual(self.read_jsonl(out)[0]["tokens"], want[:-1])

    def test_chat_masks_exactly_the_assistant_turns(self):
        stats, out = self.run_prepare([CHAT])
        [row] = self.read_jsonl(out)
        tokens, mask = row["tokens"], row["loss_mask"]
        self.assertEqual(len(tokens), len(mask))
        # The tokens are the chat template's rendering, tokenized as a whole.
        rendered = self.tok.apply_chat_template(CHAT["messages"], tokenize=False)
        self.assertEqual(self.tok.decode(tokens), rendered)
        # The masked runs are the assistant turns, each with its end-of-turn markup; nothing else.
        runs, cur = [], []
        for t, m in zip(tokens, mask):
            if m:
                cur.append(t)
            elif cur:
                runs.append(self.tok.decode(cur))
                cur = []
        if cur:
            runs.append(self.tok.decode(cur))
        self.assertEqual(runs, ["Paris.<|im_end|>\n", "Hello, it is a pleasure!<|im_end|>\n"])
        # Each run starts right after the generation prompt "<|im_start|>assistant\n".
        first = mask.index(1)
        self.assertTrue(self.tok.decode(tokens[:first]).endswith("<|im_start|>assistant\n"))
        self.assertEqual(stats.targets, sum(mask))

    def test_mixed_kinds_and_input_kind(self):
        stats, out = self.run_prepare([TEXT, CHAT], raw_lines=["", "   "])
        self.assertEqual(stats.kinds, {"text": 1, "chat": 1})
        self.assertEqual(len(self.read_jsonl(out)), 2)
        with self.assertRaisesRegex(P.PrepareError, r"line 2: a chat line, but --input-kind is text"):
            self.run_prepare([TEXT, CHAT], input_kind="text")

    def test_bin_is_little_endian_uint32_back_to_back(self):
        other = {"text": "Count to five: one, two, three."}
        stats, out = self.run_prepare([TEXT, other], fmt="bin")
        want = []
        for r in (TEXT, other):
            want += self.tok(r["text"])["input_ids"] + [self.tok.eos_token_id]
        with open(out, "rb") as f:
            data = f.read()
        self.assertEqual(len(data), 4 * len(want))
        self.assertEqual(list(struct.unpack(f"<{len(want)}I", data)), want)
        self.assertEqual(stats.tokens, len(want))

    def test_chat_into_bin_is_refused_and_nothing_is_written(self):
        with self.assertRaisesRegex(P.PrepareError, r"line 2: a conversation, but --format bin carries no loss mask"):
            self.run_prepare([TEXT, CHAT], fmt="bin")
        self.assertFalse(os.path.exists(os.path.join(self.dir, "out.bin")))
        self.assertEqual([f for f in os.listdir(self.dir) if f.startswith(".odyssey-prepare-")], [])

    def test_max_tokens_and_overflow(self):
        n = len(self.tok(TEXT["text"])["input_ids"]) + 1
        short = {"text": "Hello."}
        with self.assertRaisesRegex(P.PrepareError, rf"line 1: {n} tokens, more than --max-tokens 5"):
            self.run_prepare([TEXT, short], max_tokens=5)
        stats, out = self.run_prepare([TEXT, short], max_tokens=5, overflow="truncate")
        rows = self.read_jsonl(out)
        self.assertEqual(len(rows[0]["tokens"]), 5)
        self.assertEqual(stats.truncated, 1)
        stats, out = self.run_prepare([TEXT, short], max_tokens=5, overflow="drop")
        self.assertEqual((stats.documents, stats.dropped), (1, 1))
        stats, out = self.run_prepare([TEXT], max_tokens=5, overflow="keep")
        self.assertEqual(len(self.read_jsonl(out)[0]["tokens"]), n)
        # A conversation cut before its first assistant token has nothing left to learn.
        with self.assertRaisesRegex(P.PrepareError, r"no assistant token is left to predict after truncation"):
            self.run_prepare([CHAT], max_tokens=4, overflow="truncate")
        for bad, msg in [(dict(max_tokens=1), r"--max-tokens \(1\) must be 0 \(no limit\) or >= 2"),
                         (dict(overflow="wrap"), r"--overflow 'wrap' must be one of"),
                         (dict(fmt="parquet"), r"--format 'parquet' must be jsonl or bin")]:
            with self.assertRaisesRegex(P.PrepareError, msg):
                self.run_prepare([TEXT], **bad)

    def test_vocab_size_of_the_model_is_enforced(self):
        with self.assertRaisesRegex(P.PrepareError, r"line 1: token id \d+ \(position \d+\) is >= the model's vocab_size 10"):
            self.run_prepare([TEXT], vocab_size=10)

    def test_bad_lines_name_the_line_and_the_field(self):
        cases = [
            ([], ["{not json"], r"line 1: invalid JSON"),
            ([[1, 2]], [], r"line 1: expected a JSON object, got list"),
            ([{"text": "a", "messages": []}], [], r'line 1: needs exactly one of "text"'),
            ([{"prompt": "a"}], [], r'line 1: needs exactly one of "text"'),
            ([{"text": 3}], [], r"line 1: text must be a string, got int"),
            ([TEXT, {"messages": []}], [], r"line 2: messages must be a non-empty array"),
            ([{"messages": [{"role": "user"}]}], [], r"line 1: messages\[0\].content must be a string"),
            ([{"messages": [{"role": "user", "content": "hi"}]}], [], r"line 1: messages has no assistant turn"),
        ]
        for rows, raw, msg in cases:
            with self.subTest(msg=msg):
                with self.assertRaisesRegex(P.PrepareError, msg):
                    self.run_prepare(rows, raw_lines=raw)

    def test_a_tokenizer_without_a_chat_template_is_refused(self):
        saved = self.tok.chat_template
        try:
            self.tok.chat_template = None
            with self.assertRaisesRegex(P.PrepareError, r"the tokenizer has no chat_template .* --chat-template"):
                self.run_prepare([CHAT])
        finally:
            self.tok.chat_template = saved

    def test_console_entry_point(self):
        src = self.write("cli.jsonl", [CHAT, TEXT])
        out = os.path.join(self.dir, "cli-out.jsonl")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        run = subprocess.run([sys.executable, "-m", "odyssey_client.prepare", "--tokenizer", self.tok_dir,
                              "--input", src, "--output", out], capture_output=True, text=True, env=env, timeout=300)
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertRegex(run.stdout, r"cli-out.jsonl: 2 documents \(1 text, 1 chat\), \d+ tokens, \d+ targets")
        self.assertEqual(len(self.read_jsonl(out)), 2)
        run = subprocess.run([sys.executable, "-m", "odyssey_client.prepare", "--tokenizer",
                              os.path.join(self.dir, "nope"), "--input", src, "--output", out],
                             capture_output=True, text=True, env=env, timeout=300)
        self.assertEqual(run.returncode, 2)
        self.assertRegex(run.stderr, r"^odyssey-prepare: --tokenizer '.*nope': not a folder")


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + [a for a in sys.argv[1:] if a != "--installed"])
