"""A padded vocabulary through render -> engine -> derender (tiny-qwen2-padded: 1088 embedding
rows, 1013 tokenizer entries, so ids 1013..1087 are padding ids, as Qwen's 151669..151935 are).

With --no-exclude-padding-ids the engine samples over every row, as Hugging Face and vLLM do: at
temperature 2 padding ids come up in most streams, derender decodes them as empty text (as HF's
decode does) and no stream dies. With the default exclusion no padding id is ever sampled, nor
offered as a logprob alternative. Render and engine report the same sizes.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tito_client.pipeline import ChatPipeline, Endpoints
from tito_models.tiny import PADDED_VOCAB_ROWS
from tito.v1 import chat_pb2, engine_pb2, render_pb2
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_engine.config import EngineConfig
from tito_engine.server import create_server as create_engine
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render

TOKENIZER_ENTRIES = 1013
SEEDS = range(16)
NEW_TOKENS = 48
TIMEOUT = 60


@pytest.fixture(scope="module")
def servers(tiny_padded_model, module_aio_server):
    model = str(tiny_padded_model)
    # No parsers: the content is then exactly the decoded text, comparable with HF's decode.
    render = module_aio_server(lambda: create_render(RenderConfig(
        address="127.0.0.1:0", model=model, reasoning_parser="none", tool_parser="none")))
    derender = module_aio_server(lambda: create_derender(DerenderConfig(address="127.0.0.1:0", model=model)))
    # The default (exclusion on, None) runs as deployed, in a child process; the other on a thread.
    engines = {exclude: module_aio_server(lambda exclude=exclude: create_engine(EngineConfig(
        address="127.0.0.1:0", model=model, device="cpu", engine_process=exclude,
        exclude_padding_ids=None if exclude else False)))
        for exclude in (False, True)}
    return render, engines, derender


def pipeline(servers, exclude: bool) -> ChatPipeline:
    render, engines, derender = servers
    return ChatPipeline(Endpoints(render.address, engines[exclude].address, derender.address), timeout=TIMEOUT)


def hot_chat(seed: int) -> render_pb2.RenderChatRequest:
    request = render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content="Tell me a story.")])
    request.sampling.temperature = 2.0
    request.sampling.seed = seed
    request.sampling.max_tokens = NEW_TOKENS
    request.sampling.ignore_eos = True
    request.sampling.logprobs = True
    request.sampling.top_logprobs = 5
    return request


def run(client: ChatPipeline, seed: int) -> tuple[str, list, list, object]:
    """(content, logprob entries, their alternatives, the last chunk) of one streamed chat."""
    chunks = list(client.stream_chat(hot_chat(seed)))
    entries = [entry for chunk in chunks for entry in chunk.logprobs]
    alternatives = [top for entry in entries for top in entry.top_logprobs]
    return "".join(c.content for c in chunks), entries, alternatives, chunks[-1]


def test_both_services_report_the_same_sizes(servers):
    with pipeline(servers, exclude=True) as client:
        render_info = client.render.GetModelInfo(render_pb2.RenderServiceGetModelInfoRequest(), timeout=TIMEOUT)
        engine_info = client.engine.GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)
    assert render_info.vocab_size == engine_info.vocab_size == PADDED_VOCAB_ROWS
    assert render_info.tokenizer_vocab_size == engine_info.tokenizer_vocab_size == TOKENIZER_ENTRIES


def test_sampled_padding_ids_decode_as_hf_decodes_and_never_kill_a_stream(servers, tiny_padded_model):
    hf = AutoTokenizer.from_pretrained(str(tiny_padded_model))
    streams_with_padding = 0
    with pipeline(servers, exclude=False) as client:
        for seed in SEEDS:
            content, entries, alternatives, last = run(client, seed)
            ids = [entry.token_id for entry in entries]
            assert len(ids) == NEW_TOKENS and last.finish_reason == engine_pb2.FINISH_REASON_LENGTH
            streams_with_padding += any(i >= TOKENIZER_ENTRIES for i in ids)
            assert content == hf.decode(ids, skip_special_tokens=True)
            for token in entries + alternatives:
                assert 0 <= token.token_id < PADDED_VOCAB_ROWS
                if token.token_id >= TOKENIZER_ENTRIES:  # HF: convert_ids_to_tokens gives None, decode ""
                    assert token.token == hf.decode([token.token_id]) == "" and token.bytes == b""
    # The scenario is real: most hot streams draw a padding id (75 of 1088 rows).
    assert streams_with_padding >= len(SEEDS) // 2


def test_excluded_padding_ids_are_never_sampled_nor_offered(servers):
    with pipeline(servers, exclude=True) as client:
        for seed in SEEDS:
            _, entries, alternatives, last = run(client, seed)
            assert len(entries) == NEW_TOKENS and last.finish_reason == engine_pb2.FINISH_REASON_LENGTH
            assert max(token.token_id for token in entries + alternatives) < TOKENIZER_ENTRIES
