"""odyssey-prepare: text or chat JSONL -> the engine's training data, through a Hugging Face
tokenizer.

    odyssey-prepare --tokenizer MODEL_DIR --input chat.jsonl --output train.jsonl
    odyssey-prepare --tokenizer MODEL_DIR --input text.jsonl --output train.bin --format bin
    python -m odyssey_client.prepare ...   (the same)

Input: one JSON object per line (blank lines skipped), each either
  {"text": "..."}                                   a document; every token is a target, or
  {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}
                                                    a conversation, rendered with the tokenizer's
                                                    chat template; only the assistant turns'
                                                    tokens are targets (loss mask).
Output (docs/data.md has them byte for byte; engine/data.h reads them):
  jsonl  {"tokens": [...]} per document, plus "loss_mask": [0/1...] for conversations
  bin    little-endian uint32 token ids, documents back to back; it carries no loss mask and no
         document boundaries, so it takes text documents only.

The tokenizer is `transformers.AutoTokenizer.from_pretrained(MODEL_DIR)`, read from the local
folder only (no hub). Token ids are checked against the model's vocab_size (MODEL_DIR/config.json,
or --vocab-size). Errors name the line and the field, or the option and the rule; the output is
written atomically (nothing is left behind on an error).
"""
import argparse
import json
import os
import struct
import sys
import tempfile
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

OVERFLOW = ("error", "truncate", "drop", "keep")


class PrepareError(Exception):
    """Bad input or options: the message names the line and field, or the option and the rule."""


@dataclass
class Document:
    tokens: List[int]
    loss_mask: Optional[List[int]] = None  # None: every token is a target (text documents)


@dataclass
class Stats:
    documents: int = 0
    tokens: int = 0
    targets: int = 0
    truncated: int = 0
    dropped: int = 0
    kinds: dict = field(default_factory=lambda: {"text": 0, "chat": 0})


def load_tokenizer(path: str):
    """The Hugging Face tokenizer of a local folder (never the hub)."""
    if not os.path.isdir(path):
        raise PrepareError(f"--tokenizer {path!r}: not a folder (a Hugging Face model or tokenizer folder)")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise PrepareError("odyssey-prepare needs transformers: pip install 'odyssey-client[prepare]'") from e
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, ... for unusable folders
        raise PrepareError(f"--tokenizer {path!r}: cannot load a tokenizer ({type(e).__name__}: {e})") from e


def model_vocab_size(tokenizer_dir: str) -> Optional[int]:
    """vocab_size from the folder's config.json, when it has one."""
    path = os.path.join(tokenizer_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    v = config.get("vocab_size", config.get("text_config", {}).get("vocab_size"))
    return int(v) if v is not None else None


def _encode_text(tok, text: str, add_eos: bool) -> List[int]:
    ids = list(tok(text, add_special_tokens=True)["input_ids"])
    if add_eos and tok.eos_token_id is not None and (not ids or ids[-1] != tok.eos_token_id):
        ids.append(tok.eos_token_id)
    return ids


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise PrepareError(f"{where}: messages must be a non-empty array of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PrepareError(f"{where}: messages[{i}] must be an object, got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise PrepareError(f"{where}: messages[{i}].{key} must be a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise PrepareError(f"{where}: messages has no assistant turn (nothing to learn: the loss is on assistant turns)")


def _render(tok, messages, generation_prompt: bool, where: str) -> str:
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # the template's own errors (jinja2 exceptions, ValueError)
        raise PrepareError(f"{where}: the chat template failed ({type(e).__name__}: {e})") from e


def assistant_spans(tok, messages, where: str) -> Tuple[str, List[Tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns. An assistant
    turn's span is what rendering it adds after the prompt that asks for it (the template's
    generation prompt): its content and its end-of-turn markup, which the model must learn to
    emit. REQUIRES: the template renders append-only (each prefix of the conversation renders to
    a prefix of the whole), else PrepareError: the mask could not be placed."""
    full = _render(tok, messages, False, where)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        # A conversation that opens with the assistant has no prompt to render: its first turn
        # counts from the start of the text.
        before = _render(tok, messages[:i], True, where) if i > 0 else ""
        upto = _render(tok, messages[: i + 1], False, where)
        if not upto.startswith(before) or not full.startswith(upto):
            raise PrepareError(
                f"{where}: the chat template does not render conversations append-only (messages[{i}] changes "
                "the text before it), so the assistant turns cannot be located for the loss mask")
        if len(upto) > len(before):
            spans.append((len(before), len(upto)))
    return full, spans


def encode_chat(tok, messages, where: str) -> Document:
    """Tokens of the rendered conversation and a loss mask of 1 on the tokens that start inside
    an assistant turn's span."""
    if not getattr(tok, "chat_template", None):
        raise PrepareError(f"{where}: the tokenizer has no chat_template (tokenizer_config.json), which chat data "
                           "needs; give one with --chat-template FILE")
    if not getattr(tok, "is_fast", False):
        raise PrepareError(f"{where}: chat data needs a fast tokenizer (tokenizer.json), for the character offsets "
                           "that place the loss mask")
    _check_messages(messages, where)
    text, spans = assistant_spans(tok, messages, where)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = []
    for start, end in offsets:
        inside = any(b <= start < e for b, e in spans) and end > start
        mask.append(1 if inside else 0)
    return Document(ids, mask)


def read_documents(path: str, tok, add_eos: bool, kind: str):
    """Yields (line number, Document, 'text' | 'chat') for each non-blank line of `path`."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise PrepareError(f"--input {path!r}: cannot open ({e.strerror})") from e
    with f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PrepareError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(obj, dict):
                raise PrepareError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            has_text, has_messages = "text" in obj, "messages" in obj
            if has_text == has_messages:
                raise PrepareError(f"{where}: needs exactly one of \"text\" (a document) or \"messages\" (a conversation)")
            this = "text" if has_text else "chat"
            if kind != "auto" and this != kind:
                raise PrepareError(f"{where}: a {this} line, but --input-kind is {kind}")
            if has_text:
                if not isinstance(obj["text"], str):
                    raise PrepareError(f"{where}: text must be a string, got {type(obj['text']).__name__}")
                yield line_no, Document(_encode_text(tok, obj["text"], add_eos)), this
            else:
                yield line_no, encode_chat(tok, obj["messages"], where), this


def apply_limit(doc: Document, max_tokens: int, overflow: str, where: str) -> Tuple[Optional[Document], bool]:
    """(document or None when dropped, whether it was truncated) under --max-tokens/--overflow."""
    if max_tokens <= 0 or len(doc.tokens) <= max_tokens:
        return doc, False
    if overflow == "keep":
        return doc, False
    if overflow == "drop":
        return None, False
    if overflow == "error":
        raise PrepareError(f"{where}: {len(doc.tokens)} tokens, more than --max-tokens {max_tokens} "
                           "(--overflow truncate|drop|keep to accept it)")
    mask = doc.loss_mask[:max_tokens] if doc.loss_mask is not None else None
    return Document(doc.tokens[:max_tokens], mask), True


def prepare(tokenizer, input_path: str, output_path: str, fmt: str = "jsonl", max_tokens: int = 0,
            overflow: str = "error", add_eos: bool = True, vocab_size: Optional[int] = None,
            input_kind: str = "auto") -> Stats:
    """Converts `input_path` into `output_path` (format `fmt`), atomically. Returns the counts."""
    if fmt not in ("jsonl", "bin"):
        raise PrepareError(f"--format {fmt!r} must be jsonl or bin")
    if overflow not in OVERFLOW:
        raise PrepareError(f"--overflow {overflow!r} must be one of {', '.join(OVERFLOW)}")
    if max_tokens < 0 or (max_tokens == 1):
        raise PrepareError(f"--max-tokens ({max_tokens}) must be 0 (no limit) or >= 2 (a target needs a token before it)")
    if input_kind not in ("auto", "text", "chat"):
        raise PrepareError(f"--input-kind {input_kind!r} must be auto, text or chat")
    if vocab_size is not None and not 0 < vocab_size <= 2**32:
        raise PrepareError(f"--vocab-size ({vocab_size}) must be in [1, 2^32] (ids are stored as uint32)")
    out_dir = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(out_dir):
        raise PrepareError(f"--output {output_path!r}: folder {out_dir!r} does not exist")
    stats = Stats()
    fd, tmp = tempfile.mkstemp(prefix=".odyssey-prepare-", dir=out_dir)
    try:
        with os.fdopen(fd, "wb") as out:
            for line_no, doc, kind in read_documents(input_path, tokenizer, add_eos, input_kind):
                where = f"{input_path} line {line_no}"
                if kind == "chat" and fmt == "bin":
                    raise PrepareError(f"{where}: a conversation, but --format bin carries no loss mask (a bare uint32 "
                                       "stream); chat data needs --format jsonl")
                doc, truncated = apply_limit(doc, max_tokens, overflow, where)
                if doc is None:
                    stats.dropped += 1
                    continue
                if vocab_size is not None:
                    for i, t in enumerate(doc.tokens):
                        if t >= vocab_size:
                            raise PrepareError(f"{where}: token id {t} (position {i}) is >= the model's vocab_size "
                                               f"{vocab_size}; the tokenizer does not fit the model")
                targets = len(doc.tokens) - 1 if doc.loss_mask is None else sum(doc.loss_mask[1:])
                if doc.loss_mask is not None and targets == 0:
                    raise PrepareError(f"{where}: no assistant token is left to predict"
                                       + (" after truncation to --max-tokens" if truncated else ""))
                stats.truncated += truncated
                stats.documents += 1
                stats.kinds[kind] += 1
                stats.tokens += len(doc.tokens)
                stats.targets += max(targets, 0)
                if fmt == "bin":
                    out.write(struct.pack(f"<{len(doc.tokens)}I", *doc.tokens))
                else:
                    row = {"tokens": doc.tokens}
                    if doc.loss_mask is not None:
                        row["loss_mask"] = doc.loss_mask
                    out.write(json.dumps(row, separators=(",", ":")).encode() + b"\n")
            out.flush()
            os.fsync(out.fileno())
        if stats.documents == 0:
            raise PrepareError(f"--input {input_path!r}: no documents" +
                               (f" ({stats.dropped} dropped by --max-tokens)" if stats.dropped else ""))
        os.replace(tmp, output_path)
    except BaseException:
        os.unlink(tmp)
        raise
    return stats


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="odyssey-prepare",
        description="Tokenize text or chat JSONL with a Hugging Face tokenizer into odyssey's jsonl or bin "
                    "training data (docs/data.md). Chat: loss only on assistant turns.")
    p.add_argument("--tokenizer", required=True, help="local Hugging Face model or tokenizer folder")
    p.add_argument("--input", required=True, help='JSONL: {"text": ...} or {"messages": [...]} per line')
    p.add_argument("--output", required=True, help="file to write (atomically)")
    p.add_argument("--format", default="jsonl", help="jsonl (tokens + loss_mask; default) or bin (uint32 "
                   "stream, text only)")
    p.add_argument("--input-kind", default="auto", help="auto (per line), text or chat: refuse the other kind")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="longest document kept as it is (0 = no limit; the engine cuts long documents into "
                        "data.seq_len pieces itself)")
    p.add_argument("--overflow", default="error", help="a document over --max-tokens: error (default), truncate "
                   "(keep its first --max-tokens tokens), drop, or keep")
    p.add_argument("--no-eos", action="store_true", help="text documents: do not append the tokenizer's eos token")
    p.add_argument("--chat-template", help="a Jinja chat template file, for a tokenizer without one")
    p.add_argument("--vocab-size", type=int, help="refuse ids >= this (default: vocab_size of the tokenizer "
                   "folder's config.json, when it has one)")
    args = p.parse_args(argv)
    # The command needs only the tokenizer: without this, importing transformers imports torch,
    # seconds of start-up for nothing. (prepare() as a library leaves the caller's process alone.)
    os.environ.setdefault("USE_TORCH", "0")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        tok = load_tokenizer(args.tokenizer)
        if args.chat_template:
            try:
                with open(args.chat_template, encoding="utf-8") as f:
                    tok.chat_template = f.read()
            except OSError as e:
                raise PrepareError(f"--chat-template {args.chat_template!r}: cannot read ({e.strerror})") from e
        vocab = args.vocab_size if args.vocab_size is not None else model_vocab_size(args.tokenizer)
        stats = prepare(tok, args.input, args.output, fmt=args.format, max_tokens=args.max_tokens,
                        overflow=args.overflow, add_eos=not args.no_eos, vocab_size=vocab,
                        input_kind=args.input_kind)
    except PrepareError as e:
        print(f"odyssey-prepare: {e}"[:4000], file=sys.stderr)
        return 2
    extra = "".join([f", {stats.truncated} truncated" if stats.truncated else "",
                     f", {stats.dropped} dropped" if stats.dropped else ""])
    print(f"odyssey-prepare: {args.output}: {stats.documents} documents ({stats.kinds['text']} text, "
          f"{stats.kinds['chat']} chat), {stats.tokens} tokens, {stats.targets} targets{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
