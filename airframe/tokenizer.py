"""Tokenizers built from GGUF metadata alone, giving llama.cpp's token ids.

The ground truth for a GGUF's tokenization is llama.cpp (src/llama-vocab.cpp); we build a
`tokenizers.Tokenizer` (Hugging Face) that reproduces it, and cache it as JSON beside the model.

- `tokenizer.ggml.model = gpt2`: byte-level BPE with the file's merges. The split regexes in front
  of it are chosen from `tokenizer.ggml.pre` (PRE_TOKENIZER_SPLITS, the same table llama.cpp keeps).
- `tokenizer.ggml.model = llama`: SentencePiece-style vocabulary with scores and `<0xNN>` byte
  fallback. llama.cpp repeatedly merges the adjacent pair whose joined text is the token with the
  highest score, leftmost on ties. We express that as a BPE merge list: for every token t and every
  split t = a + b into two tokens, a merge (a, b), ranked by score(t). A BPE applies the best-ranked
  pair present, leftmost on ties, so the two agree whenever the tokens that can be formed have
  distinct scores (Gemma 3's do; tests check random vocabularies against `reference_spm_encode`,
  llama.cpp's algorithm in Python). Where two different formable tokens share a score, BPE prefers
  the lower id and llama.cpp the leftmost pair: ids can differ there.

Checked against llama.cpp itself (llama-cpp-python 0.3.36) on SmolLM2 and Gemma 3: ~10,000 strings
(license and code text, random mixes of whitespace, CJK, emoji and special-token text), with and
without BOS and special parsing, gave identical ids; on Qwen2.5-Coder (pre-type `qwen2`: one digit
per piece, newlines kept with the whitespace before them), 3,055 such strings did.

Special tokens follow llama.cpp: user-defined tokens (Gemma's runs of spaces, tabs and newlines,
its HTML tags) are always matched as whole tokens before the model sees the text, because the
vocabulary relies on them; control and unknown tokens are matched only with `parse_special=True`.
A literal U+2581 in the text decodes as a space with a SentencePiece vocabulary (as in llama.cpp).
"""

from __future__ import annotations

import hashlib
import heapq
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tqdm import tqdm

from .errors import ParameterError, TokenizerError, UnsupportedError, excerpt
from .gguf_file import GGUFFile

CACHE_FORMAT = "airframe-tokenizer-2"  # change when the built tokenizer changes for the same metadata
SPACE_MARK = "\u2581"  # SentencePiece's stand-in for a space

# The split regexes llama.cpp runs before byte-level BPE, per `tokenizer.ggml.pre`; each splits the
# pieces the previous one left, keeping matches and the text between them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS = r"\p{N}"
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    **dict.fromkeys(("gpt-2", "phi-2", "roberta-bpe", "mpt", "olmo", "jais"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    (_DIGITS, _GPT2)),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "stablelm2", "megrez"), (_QWEN2,)),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
}
# Pre-types whose whole pieces are looked up before merging, and that want BOS by default.
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "falcon3"}

# Tokens that end generation when present, as llama.cpp finds them by text.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "<|end_of_text|>", "<|return|>", "<|call|>", "<end_of_utterance>", "<eos>")
# ... and these only as control tokens: Gemma's and Qwen's "</s>" is HTML's strikethrough, text a model writes.
EOG_CONTROL_TEXTS = ("</s>",)
# Fill-in-the-middle markers end generation too (a code model writes one when it leaves the file):
# the file's tokenizer.ggml.<role>_token_id, else the first of these texts the vocabulary has.
FIM_TEXTS = {"fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
             "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
             "fim_sep": ("<|file_sep|>",)}
_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)


@dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` metadata, checked."""

    path: Path
    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece-style)
    pre: str
    tokens: list[str]
    types: np.ndarray  # (n_vocab,) int32 TokenType values
    scores: np.ndarray  # (n_vocab,) float32; zeros when the file has none
    merges: list[str]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    eot_id: int | None
    eom_id: int | None
    fim_ids: tuple[int, ...]  # FIM_TEXTS' roles found, in that order
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool

    @cached_property
    def token_ids(self) -> dict[str, int]:
        return {t: i for i, t in enumerate(self.tokens)}

    def ids_of_type(self, *types: TokenType) -> list[int]:
        return [int(i) for i in np.flatnonzero(np.isin(self.types, [int(t) for t in types]))]


def read_vocab(gf: GGUFFile) -> GGUFVocab:
    """The tokenizer keys of a GGUF file, with llama.cpp's defaults for the optional ones."""
    model = gf.get("tokenizer.ggml.model")
    if not isinstance(model, str) or model not in ("gpt2", "llama"):
        raise UnsupportedError(f"{gf.path}: tokenizer.ggml.model = {excerpt(model)}, expected 'gpt2' (byte-level BPE) "
                               f"or 'llama' (SentencePiece-style)")
    tokens = _read_tokens(gf)
    n = len(tokens)
    pre = gf.get("tokenizer.ggml.pre", "default") if model == "gpt2" else "default"
    if not isinstance(pre, str) or pre not in PRE_TOKENIZER_SPLITS:
        raise UnsupportedError(f"{gf.path}: tokenizer.ggml.pre = {excerpt(pre)}, expected one of "
                               f"{', '.join(sorted(PRE_TOKENIZER_SPLITS))}")
    merges = gf.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges) or (model == "gpt2" and not merges):
        found = f"{len(merges)} strings" if isinstance(merges, list) else type(merges).__name__
        raise TokenizerError(f"{gf.path}: tokenizer.ggml.merges is {found}, expected a non-empty array of strings")
    is_spm = model == "llama"
    return GGUFVocab(
        path=gf.path, model=model, pre=pre, tokens=tokens,
        types=_read_array(gf, "tokenizer.ggml.token_type", n, np.int32, TokenType.NORMAL),
        scores=_read_array(gf, "tokenizer.ggml.scores", n, np.float32, 0.0),
        merges=merges,
        bos_id=_read_id(gf, "bos_token_id", n), eos_id=_read_id(gf, "eos_token_id", n),
        unk_id=_read_id(gf, "unknown_token_id", n), pad_id=_read_id(gf, "padding_token_id", n),
        eot_id=_read_id(gf, "eot_token_id", n), eom_id=_read_id(gf, "eom_token_id", n),
        fim_ids=_fim_ids(gf, tokens),
        add_bos=_read_flag(gf, "add_bos_token", is_spm or pre in _IGNORE_MERGES),
        add_eos=_read_flag(gf, "add_eos_token", False),
        add_space_prefix=_read_flag(gf, "add_space_prefix", is_spm),
    )


def _fim_ids(gf: GGUFFile, tokens: list[str]) -> tuple[int, ...]:
    wanted = {text for texts in FIM_TEXTS.values() for text in texts}
    ids = {t: i for i, t in enumerate(tokens) if t in wanted}
    found = []
    for role, texts in FIM_TEXTS.items():
        token_id = _read_id(gf, f"{role}_token_id", len(tokens))
        if token_id is None:
            token_id = next((ids[t] for t in texts if t in ids), None)
        if token_id is not None:
            found.append(token_id)
    return tuple(found)


def _read_flag(gf: GGUFFile, key: str, default: bool) -> bool:
    value = gf.get(f"tokenizer.ggml.{key}", default)
    if not isinstance(value, (bool, int, np.integer)):
        raise TokenizerError(f"{gf.path}: tokenizer.ggml.{key} = {type(value).__name__}, expected a boolean")
    return bool(value)


def _read_tokens(gf: GGUFFile) -> list[str]:
    tokens = gf.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
        raise TokenizerError(f"{gf.path}: tokenizer.ggml.tokens = {type(tokens).__name__}, "
                             f"expected a non-empty array of strings")
    unique = set(tokens)
    if "" in unique:
        tokens = [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp's name for empty entries
        unique = set(tokens)
    if len(unique) != len(tokens):
        seen: set[str] = set()
        duplicate = next(t for t in tokens if t in seen or seen.add(t))
        raise TokenizerError(f"{gf.path}: tokenizer.ggml.tokens holds {excerpt(duplicate)} twice, expected unique tokens")
    return tokens


def _read_array(gf: GGUFFile, key: str, n: int, dtype, default) -> np.ndarray:
    value = gf.get(key)
    if value is None:
        return np.full(n, default, dtype=dtype)
    if not isinstance(value, np.ndarray) or value.shape != (n,):
        found = value.shape if isinstance(value, np.ndarray) else type(value).__name__
        raise TokenizerError(f"{gf.path}: {key} is {found}, expected a numeric array of {n} entries (one per token)")
    return value.astype(dtype)


def _read_id(gf: GGUFFile, key: str, n: int) -> int | None:
    value = gf.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < n:
        raise TokenizerError(f"{gf.path}: tokenizer.ggml.{key} = {excerpt(value)}, expected a token id in 0..{n - 1}")
    return int(value)


# ---- building the Hugging Face tokenizer ----------------------------------------------------------
def build_hf_tokenizer(vocab: GGUFVocab) -> Tokenizer:
    """A `tokenizers.Tokenizer` that gives llama.cpp's ids for this vocabulary."""
    hf = _build_bpe(vocab) if vocab.model == "gpt2" else _build_spm(vocab)
    specials = vocab.ids_of_type(*_SPECIAL_TYPES) + _eog_text_ids(vocab)
    user_defined = vocab.ids_of_type(TokenType.USER_DEFINED)
    hf.add_tokens([AddedToken(vocab.tokens[i], special=False, normalized=False) for i in user_defined])
    hf.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False)
                           for i in sorted(set(specials))])
    hf.post_processor = _post_processor(vocab)
    return hf


def _build_bpe(vocab: GGUFVocab) -> Tokenizer:
    ids = vocab.token_ids
    merges = []
    for i, line in enumerate(vocab.merges):
        cut = line.find(" ", 1)  # llama.cpp splits at the first space after the first character
        left, right = line[:cut], line[cut + 1:]
        if cut < 0 or left not in ids or right not in ids or left + right not in ids:
            raise TokenizerError(f"{vocab.path}: tokenizer.ggml.merges[{i}] = {excerpt(line)}, expected two tokens "
                                 f"separated by a space whose concatenation is also a token")
        merges.append((left, right))
    bpe = models.BPE(vocab=ids, merges=merges, ignore_merges=vocab.pre in _IGNORE_MERGES)
    hf = Tokenizer(bpe)
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in PRE_TOKENIZER_SPLITS[vocab.pre]]
    hf.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    return hf


def _build_spm(vocab: GGUFVocab) -> Tokenizer:
    ids = vocab.token_ids
    unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
    bpe = models.BPE(vocab=ids, merges=spm_merges(vocab), byte_fallback=True, unk_token=unk)
    hf = Tokenizer(bpe)
    escape = [normalizers.Replace(" ", SPACE_MARK)]
    hf.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE_MARK)] if vocab.add_space_prefix else [])
                                         + escape)
    steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    hf.decoder = decoders.Sequence(steps)
    return hf


def spm_merges(vocab: GGUFVocab) -> list[tuple[str, str]]:
    """Every split of every mergeable token into two tokens, best score first (ties: lower id first).

    User-defined tokens are left out: they are cut out of the text before merging, never formed.
    """
    ids = vocab.token_ids
    skip = set(vocab.ids_of_type(TokenType.USER_DEFINED))
    ranked = []
    bar = tqdm(vocab.tokens, desc=f"building tokenizer for {vocab.path.name}", unit="tok",
               leave=False, disable=None, mininterval=0.5)
    for i, token in enumerate(bar):
        if i in skip:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-float(vocab.scores[i]), i, cut, left, right))
    ranked.sort(key=lambda m: m[:3])
    return [(left, right) for *_, left, right in ranked]


def _eog_text_ids(vocab: GGUFVocab) -> list[int]:
    anywhere, control = set(EOG_TEXTS), set(EOG_CONTROL_TEXTS)
    return [i for i, t in enumerate(vocab.tokens)
            if t in anywhere or (t in control and vocab.types[i] == TokenType.CONTROL)]


def _post_processor(vocab: GGUFVocab):
    before = _required_id(vocab, "bos", vocab.bos_id) if vocab.add_bos else None
    after = _required_id(vocab, "eos", vocab.eos_id) if vocab.add_eos else None
    ends = [(vocab.tokens[i], i) for i in (before, after) if i is not None]
    single = " ".join(([vocab.tokens[before]] if before is not None else []) + ["$A"]
                      + ([vocab.tokens[after]] if after is not None else []))
    pair = single + " " + single.replace("$A", "$B:1")
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=sorted(set(ends)))


def _required_id(vocab: GGUFVocab, name: str, token_id: int | None) -> int:
    if token_id is None:
        raise TokenizerError(f"{vocab.path}: tokenizer.ggml.add_{name}_token is true but "
                             f"tokenizer.ggml.{name}_token_id is missing, expected the id to add")
    return token_id


# ---- llama.cpp's SentencePiece-style algorithm, the reference the merge list is tested against -----
def reference_spm_encode(vocab: GGUFVocab, text: str, parse_special: bool = False) -> list[int]:
    """llama.cpp's SPM tokenization without BOS/EOS, written out plainly (slow; for tests)."""
    ids = vocab.token_ids
    out: list[int] = []
    after_special = True
    for piece in _partition(vocab, text, parse_special):
        if isinstance(piece, int):
            out.append(piece)
            after_special = True
            continue
        prefix = " " if vocab.add_space_prefix and after_special else ""
        out.extend(_spm_merge((prefix + piece).replace(" ", SPACE_MARK), ids, vocab.scores))
        after_special = False
    return out


def _partition(vocab: GGUFVocab, text: str, parse_special: bool) -> list[str | int]:
    """Cut special tokens out of the text, longest token first (llama.cpp's tokenizer_st_partition)."""
    kinds = (TokenType.USER_DEFINED, *_SPECIAL_TYPES) if parse_special else (TokenType.USER_DEFINED,)
    specials = sorted(vocab.ids_of_type(*kinds), key=lambda i: -len(vocab.tokens[i]))
    pieces: list[str | int] = [text] if text else []
    for token_id in specials:
        token = vocab.tokens[token_id]
        cut: list[str | int] = []
        for piece in pieces:
            if isinstance(piece, int) or token not in piece:
                cut.append(piece)
                continue
            for k, part in enumerate(piece.split(token)):
                cut.extend(([token_id] if k else []) + ([part] if part else []))
        pieces = cut
    return pieces


def _spm_merge(text: str, ids: dict[str, int], scores: np.ndarray) -> list[int]:
    symbols = list(text)  # one per character; merged-away symbols become ""
    nxt = list(range(1, len(symbols))) + [-1]
    prev = list(range(-1, len(symbols) - 1))
    queue: list[tuple[float, int, int, int]] = []  # (-score, left, right, joined length)

    def offer(left: int, right: int) -> None:
        if left >= 0 and right >= 0 and (joined := symbols[left] + symbols[right]) in ids:
            heapq.heappush(queue, (-float(scores[ids[joined]]), left, right, len(joined)))

    for i in range(1, len(symbols)):
        offer(i - 1, i)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != size:
            continue  # stale: one side was merged since
        symbols[left] += symbols[right]
        symbols[right] = ""
        nxt[left] = nxt[right]
        if nxt[left] >= 0:
            prev[nxt[left]] = left
        offer(prev[left], left)
        offer(left, nxt[left])
    out = []
    for piece in filter(None, symbols):
        out.extend([ids[piece]] if piece in ids else [ids[f"<0x{b:02X}>"] for b in piece.encode("utf-8")])
    return out


# ---- cache ------------------------------------------------------------------------------------------
def cache_key(vocab: GGUFVocab) -> str:
    digest = hashlib.sha256(f"{CACHE_FORMAT} {tokenizers.__version__} {vocab.model} {vocab.pre} "
                            f"{vocab.bos_id} {vocab.eos_id} {vocab.unk_id} {vocab.eot_id} {vocab.eom_id} "
                            f"{vocab.add_bos} {vocab.add_eos} {vocab.add_space_prefix}".encode())
    for strings in (vocab.tokens, vocab.merges):
        digest.update(np.fromiter(map(len, strings), dtype=np.int64, count=len(strings)).tobytes())
        digest.update("\0".join(strings).encode("utf-8", "surrogatepass"))
    digest.update(vocab.types.astype("<i4").tobytes())
    digest.update(vocab.scores.astype("<f4").tobytes())
    return digest.hexdigest()


def cache_paths(model_path: Path, key: str) -> list[Path]:
    """Beside the model first; the user cache when the model's folder is not writable."""
    fallback = Path.home() / ".cache" / "airframe" / "tokenizers" / f"{model_path.name}.{key[:16]}.tokenizer.json"
    return [model_path.with_name(model_path.name + ".tokenizer.json"), fallback]


def _cache_header(key: str) -> bytes:
    """The file is one JSON object: this key, then the tokenizer itself."""
    return f'{{"airframe_cache_key": "{key}", "tokenizer": '.encode()


_CACHE_TAIL = b"}\n"


def _read_cache(path: Path, key: str) -> Tokenizer | None:
    try:
        content = path.read_bytes()
    except OSError:
        return None
    header = _cache_header(key)
    if not content.startswith(header) or not content.endswith(_CACHE_TAIL):
        return None  # another tokenizer's cache, another format, or cut short: rebuild
    try:
        return Tokenizer.from_buffer(content[len(header):-len(_CACHE_TAIL)])
    except Exception:  # a damaged file is rebuilt, whatever the parser says about it
        return None


def _write_cache(paths: list[Path], key: str, hf: Tokenizer) -> Path | None:
    content = _cache_header(key) + hf.to_str().encode("utf-8") + _CACHE_TAIL
    for path in paths:
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tokenizer-", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            os.replace(tmp, path)
            return path
        except OSError:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
    return None


# ---- public API --------------------------------------------------------------------------------------
class GGUFTokenizer:
    """Text <-> token ids for one GGUF vocabulary, matching llama.cpp."""

    def __init__(self, vocab: GGUFVocab, hf: Tokenizer, cache_path: Path | None = None, from_cache: bool = False):
        self.vocab = vocab
        self.hf = hf
        self.vocab_size = len(vocab.tokens)
        self.bos_id = vocab.bos_id
        self.eos_id = vocab.eos_id
        self.unk_id = vocab.unk_id
        self.pad_id = vocab.pad_id
        self.add_bos = vocab.add_bos
        self.add_eos = vocab.add_eos
        self.cache_path = cache_path  # where the built tokenizer is stored (None: not stored)
        self.from_cache = from_cache  # True when this load read the cache instead of building
        special = vocab.ids_of_type(TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)
        eog_texts = _eog_text_ids(vocab)
        self.special_tokens: dict[str, int] = {vocab.tokens[i]: i for i in special + eog_texts}
        # what only parse_special reads as one id (user-defined tokens are matched in any text)
        self.control_texts: tuple[str, ...] = tuple(
            vocab.tokens[i] for i in vocab.ids_of_type(TokenType.CONTROL, TokenType.UNKNOWN) + eog_texts if vocab.tokens[i])
        eog = set(eog_texts) | set(vocab.fim_ids) | {vocab.eos_id, vocab.eot_id, vocab.eom_id}
        self.eog_ids: frozenset[int] = frozenset(i for i in eog if i is not None)
        self._lock = threading.Lock()  # encode_special_tokens is a setting of the shared hf object
        self.hf.encode_special_tokens = True  # used directly, hf reads control tokens as plain text too

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of `text`; `add_special` adds BOS/EOS as the file asks, `parse_special` reads
        control tokens such as `<|im_start|>` written in the text as single ids."""
        if not isinstance(text, str):
            raise ParameterError(f"text to encode is {type(text).__name__}, expected str")
        with self._lock:
            self.hf.encode_special_tokens = not parse_special
            try:
                return self.hf.encode(text, add_special_tokens=add_special).ids
            finally:
                self.hf.encode_special_tokens = True

    def encode_parts(self, parts: list[tuple[str, bool]], add_special: bool = True) -> list[int]:
        """Token ids of the concatenated texts, control tokens read only in the parts whose flag
        is True: the same ids as encode(joined, parse_special=True) where the other parts hold no
        control token text, and that text as plain text where they do."""
        pieces: list[str | int] = []
        for text, parse_special in parts:
            if not isinstance(text, str):
                raise ParameterError(f"text to encode is {type(text).__name__}, expected str")
            for piece in self._split_special(text) if parse_special else [text]:
                if isinstance(piece, str) and pieces and isinstance(pieces[-1], str):
                    pieces[-1] += piece  # text runs are cut only at control tokens, as encode() cuts them
                else:
                    pieces.append(piece)
        ids: list[int] = []
        with self._lock:  # encode_special_tokens stays True: the runs are plain text
            for piece in pieces:
                ids += [piece] if isinstance(piece, int) else self.hf.encode(piece, add_special_tokens=False).ids
        if add_special:
            ids = ([self.bos_id] if self.add_bos else []) + ids + ([self.eos_id] if self.add_eos else [])
        return ids

    def special_in(self, text: str) -> str | None:
        """The first control token text found in `text` (None: none)."""
        return next((t for t in self.control_texts if t in text), None)

    def _split_special(self, text: str) -> list[str | int]:
        """`text` cut at the control tokens written in it (leftmost, longest first), as ids."""
        present = sorted((t for t in self.special_tokens if t and t in text), key=len, reverse=True)
        if not present:
            return [text]
        pieces: list[str | int] = []
        pos = 0
        for match in re.finditer("|".join(map(re.escape, present)), text):
            pieces += [text[pos:match.start()], self.special_tokens[match.group()]]
            pos = match.end()
        pieces.append(text[pos:])
        return [p for p in pieces if p != ""]

    def decode(self, ids, skip_special: bool = False) -> str:
        ids = [self._check_id(i) for i in ids]
        return self.hf.decode(ids, skip_special_tokens=skip_special)

    def token_text(self, token_id: int) -> str:
        """The vocabulary entry as stored in the file (`▁` for spaces, `Ġ` byte-level marks...)."""
        return self.vocab.tokens[self._check_id(token_id)]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for: a byte-fallback token gives its one byte, a control
        token its text. Concatenating these and decoding as UTF-8 gives the text."""
        text = self.token_text(token_id)
        kind = self.vocab.types[token_id]
        if kind == TokenType.BYTE and _is_byte_token(text):
            return bytes([int(text[3:5], 16)])
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            return text.encode("utf-8")
        if self.vocab.model == "gpt2":
            return byte_level_decode(text)
        return text.replace(SPACE_MARK, " ").encode("utf-8")

    def _check_id(self, token_id) -> int:
        if not isinstance(token_id, (int, np.integer)) or isinstance(token_id, bool) \
                or not 0 <= token_id < self.vocab_size:
            raise ParameterError(f"token id {token_id!r} is not in the vocabulary, expected an int in "
                                 f"0..{self.vocab_size - 1}")
        return int(token_id)


def load_tokenizer(gf: GGUFFile) -> GGUFTokenizer:
    """The tokenizer of a GGUF file, from the JSON cache when its metadata has not changed."""
    vocab = read_vocab(gf)
    key = cache_key(vocab)
    paths = cache_paths(gf.path, key)
    for path in paths:
        hf = _read_cache(path, key)
        if hf is not None:
            return GGUFTokenizer(vocab, hf, cache_path=path, from_cache=True)
    hf = build_hf_tokenizer(vocab)
    return GGUFTokenizer(vocab, hf, cache_path=_write_cache(paths, key, hf), from_cache=False)


def _is_byte_token(text: str) -> bool:
    return len(text) == 6 and text.startswith("<0x") and text.endswith(">") \
        and all(c in "0123456789ABCDEFabcdef" for c in text[3:5])


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


_BYTE_OF_CHAR = _byte_level_table()


def byte_level_decode(text: str) -> bytes:
    """The bytes behind a byte-level BPE token; text outside the alphabet is kept as UTF-8."""
    if all(c in _BYTE_OF_CHAR for c in text):
        return bytes(_BYTE_OF_CHAR[c] for c in text)
    return text.encode("utf-8")
