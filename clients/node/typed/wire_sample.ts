// The ts-proto code that buf.gen.yaml generates, on the wire (run after `npm run gen`).
//   node dist-gen/typed/wire_sample.js encode             -> base64 RenderChatRequest
//   node dist-gen/typed/wire_sample.js decode-load BASE64 -> GetLoadResponse as JSON
// A plain object for a Struct field, a uint64 as a string and enum names all encode as tito
// expects; the test suite checks the bytes with Python's own protobuf classes.
import { MmPayload } from "../gen/tito/v1/multimodal";
import { RenderChatRequest } from "../gen/tito/v1/render";
import { GetLoadResponse } from "../gen/tito/v1/engine";
import { ToolChoiceMode } from "../gen/tito/v1/chat";

function encodeSample(): string {
  const request = RenderChatRequest.fromPartial({
    messages: [{ role: "user",
                 content_parts: [{ text: "What is this?" }, { image: { data: Buffer.from([1, 2, 3]) } }] }],
    // Plain JSON for a Struct: ts-proto wraps it into the Struct message itself.
    chat_template_kwargs: { enable_thinking: false, depth: { list: [1, "two", null] } },
    tool_choice: { mode: ToolChoiceMode.TOOL_CHOICE_MODE_NONE },
    sampling: { max_tokens: 8, seed: "18446744073709551615" },
    mm_payload: MmPayload.MM_PAYLOAD_METADATA,
  });
  return Buffer.from(RenderChatRequest.encode(request).finish()).toString("base64");
}

function decodeLoad(base64: string): string {
  return JSON.stringify(GetLoadResponse.decode(Buffer.from(base64, "base64")));
}

const [command, argument] = process.argv.slice(2);
console.log(command === "encode" ? encodeSample() : decodeLoad(argument));
