"""The `developer` role (what OpenAI's SDKs and agent frameworks now send for the system prompt): a
chat template that does not name it gets it as `system`, merged as vLLM merges it; a template that
names it gets it unchanged."""

from __future__ import annotations

import pytest

from tito.errors import InvalidArgument
from tito.v1 import chat_pb2, render_pb2
from tito_render.config import RenderConfig
from tito_render.convert import chat_response
from tito_render.model import load_render_model
from tito_render.renderer import Renderer
from tito_render.template_compat import developer_as_system

#: Chats with developer messages where a template without the role needs them moved or merged.
CHATS = {
    "developer_first": [("developer", "Be brief."), ("user", "Hi")],
    "after_a_system_message": [("system", "You are tito."), ("developer", "Be brief."), ("user", "Hi")],
    "mid_conversation": [("developer", "Be brief."), ("user", "Hi"), ("assistant", "Hello."),
                         ("developer", "Now be verbose."), ("user", "Why?")],
    "system_later_too": [("user", "Hi"), ("system", "Answer in French."), ("developer", "Be brief.")],
}


@pytest.fixture(scope="module")
def renderer(tiny_text_model) -> Renderer:
    return Renderer(load_render_model(RenderConfig(model=str(tiny_text_model))))


def request(chat, **fields) -> render_pb2.RenderChatRequest:
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role=role, content=text) for role, text in chat],
                                        return_prompt_text=True, **fields)


def template_ids(renderer, messages) -> list[int]:
    ids = renderer.model.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_developer_message_renders_as_the_system_prompt_on_a_template_without_the_role(renderer):
    # The tiny model's template (Qwen3's) raises "Unexpected message role" for `developer`.
    response = chat_response(renderer, request(CHATS["developer_first"]))
    assert list(response.generate_request.token_ids) == template_ids(
        renderer, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])


def test_system_and_developer_messages_merge_into_one_leading_system_message(renderer):
    response = chat_response(renderer, request(CHATS["mid_conversation"]))
    assert list(response.generate_request.token_ids) == template_ids(renderer, [
        {"role": "system", "content": "Be brief.\n\nNow be verbose."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?"}])


def test_a_template_that_names_the_role_gets_it_unchanged(renderer):
    template = ("{% for m in messages %}{% if m.role == 'developer' %}[dev]{% endif %}"
                "{{ m.role }}: {{ m.content }}\n{% endfor %}")
    response = chat_response(renderer, request(CHATS["after_a_system_message"], chat_template=template))
    assert response.prompt_text == "system: You are tito.\n[dev]developer: Be brief.\nuser: Hi\n"


def test_a_chat_without_developer_messages_is_left_alone():
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]
    assert developer_as_system(messages, "no role names here") is messages


def test_an_image_in_a_message_that_would_be_merged_is_refused_naming_the_part():
    # vLLM drops it silently; tito would lose its place in the prompt while still sending its pixels.
    messages = [{"role": "system", "content": "s"},
                {"role": "developer", "content": [{"type": "text", "text": "look"}, {"type": "image"}]}]
    with pytest.raises(InvalidArgument) as info:
        developer_as_system(messages, "")
    assert info.value.field == "messages[1].content_parts[1]"


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(CHATS))
def test_the_ids_are_vllms(renderer, name):
    """The same conversion as vLLM 0.32's own functions, then the same template: the same ids."""
    from vllm.renderers.hf import (_consolidate_system_messages, _convert_developer_to_system,
                                   _detect_developer_role_support)

    template = renderer.model.tokenizer.chat_template
    assert not _detect_developer_role_support(template)
    conversation = [{"role": role, "content": text} for role, text in CHATS[name]]
    expected = template_ids(renderer, _consolidate_system_messages(_convert_developer_to_system(conversation)))
    assert list(chat_response(renderer, request(CHATS[name])).generate_request.token_ids) == expected
