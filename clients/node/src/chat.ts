// tito from Node: health, model info, a chat with an image through render -> engine -> derender,
// the Struct pitfall, cancelling a stream, and decoding a rich error. Each step prints one JSON
// line, so a person can read it and a test can check it.
//
//   node dist/chat.js --render 127.0.0.1:50051 --engine 127.0.0.1:50052 --derender 127.0.0.1:50053 \
//     --image photo.png --prompt "What is in this picture?"
import { readFileSync } from "fs";
import { parseArgs } from "util";
import * as grpc from "@grpc/grpc-js";
import { decodeError, isServiceError } from "./errors";
import { checkHealth } from "./health";
import { Addresses, Clients, closeAll, connect, deadline, streamChat, unary } from "./pipeline";
import { toStruct } from "./struct";

const DEADLINE_DEMO_MS = 150; // far shorter than 2000 tokens take

function report(step: string, fields: object): void {
  console.log(JSON.stringify({ step, ...fields }));
}

// Wait (up to the timeout) until each service is SERVING: NOT_SERVING while its model loads.
async function health(addresses: Addresses, timeoutMs: number): Promise<void> {
  const names = { render: "tito.v1.RenderService", engine: "tito.v1.EngineService",
                  derender: "tito.v1.DerenderService" };
  const statuses: { [service: string]: string } = {};
  const giveUp = Date.now() + timeoutMs;
  for (const [key, service] of Object.entries(names)) {
    do {
      statuses[key] = await checkHealth(addresses[key as keyof Addresses], service, timeoutMs);
      if (statuses[key] !== "SERVING") await new Promise((resolve) => setTimeout(resolve, 200));
    } while (statuses[key] !== "SERVING" && Date.now() < giveUp);
  }
  report("health", statuses);
}

async function modelInfo(clients: Clients, timeoutMs: number): Promise<number> {
  const info = await unary(clients.engine, "GetModelInfo", {}, timeoutMs);
  const load = await unary(clients.engine, "GetLoad", {}, timeoutMs);
  // Enums are names (modalities), uint64 counters are decimal strings (finished_requests).
  report("model_info", { vocab_size: info.vocab_size, modalities: info.modalities.map((m: any) => m.modality),
                         finished_requests: load.finished_requests ?? "0" });
  return info.vocab_size;
}

// chat_template_kwargs is a google.protobuf.Struct: a plain object is silently dropped by
// proto-loader, toStruct() sends it. A one-line template makes the difference visible.
async function structPitfall(clients: Clients, timeoutMs: number): Promise<void> {
  const kwargs = { greeting: "hello from node" };
  const request = (chat_template_kwargs: object) => ({
    messages: [{ role: "user", content: "Hi" }],
    chat_template: "{{ messages[0]['content'] }}|{{ greeting }}",
    chat_template_kwargs,
    return_prompt_text: true,
  });
  const plain = await unary(clients.render, "RenderChat", request(kwargs), timeoutMs);
  const converted = await unary(clients.render, "RenderChat", request(toStruct(kwargs)), timeoutMs);
  report("struct", { plain_object_prompt: plain.prompt_text, to_struct_prompt: converted.prompt_text });
}

async function imageChat(clients: Clients, prompt: string, image: Buffer, maxTokens: number,
                         timeoutMs: number): Promise<void> {
  const request = {
    messages: [{ role: "user", content_parts: [{ text: prompt }, { image: { data: image } }] }],
    // seed is a uint64: a decimal string keeps every value exact (a number is fine below 2^53).
    sampling: { max_tokens: maxTokens, temperature: 0, seed: "18446744073709551615" },
  };
  let content = "";
  let last: any;
  for await (const chunk of streamChat(clients, request, timeoutMs)) {
    content += chunk.content ?? "";
    last = chunk;
  }
  report("chat", { content, finish_reason: last?.finish_reason, usage: last?.usage });
}

// Ask for a long generation, then end the Generate stream early: cancelled by the client after
// its first message, or cut by a deadline. The client sees CANCELLED or DEADLINE_EXCEEDED, and the
// engine frees the request (GetLoad shows nothing running).
async function endStreamEarly(clients: Clients, how: "cancel" | "deadline", timeoutMs: number): Promise<void> {
  const rendered = await unary(clients.render, "RenderChat", {
    messages: [{ role: "user", content: "Count to a thousand." }],
    sampling: { max_tokens: 2000, temperature: 0, ignore_eos: true },
  }, timeoutMs);
  const call: grpc.ClientReadableStream<any> = clients.engine.Generate(rendered.generate_request,
    deadline(how === "deadline" ? DEADLINE_DEMO_MS : timeoutMs));
  let received = 0;
  const code = await new Promise<string>((resolve) => {
    call.on("data", () => { received += 1; if (how === "cancel" && received === 1) call.cancel(); });
    call.on("error", (error: grpc.ServiceError) => resolve(grpc.status[error.code]));
    call.on("end", () => resolve("OK"));
  });
  report(how, { code, received, ...await waitUntilIdle(clients, timeoutMs) });
}

async function waitUntilIdle(clients: Clients, timeoutMs: number): Promise<object> {
  let load: any;
  for (let attempt = 0; attempt < 100; attempt += 1) {
    load = await unary(clients.engine, "GetLoad", {}, timeoutMs);
    if (!load.running_requests && !load.waiting_requests) break;
    await new Promise((resolve) => setTimeout(resolve, 100));
  }
  return { running_requests: load.running_requests ?? 0, finished_requests: load.finished_requests };
}

// A token id outside the vocabulary: INVALID_ARGUMENT with ErrorInfo and a BadRequest naming it.
async function richError(clients: Clients, vocabSize: number, timeoutMs: number): Promise<void> {
  const call: grpc.ClientReadableStream<any> = clients.engine.Generate(
    { token_ids: [1, vocabSize], sampling_params: { max_tokens: 4 } }, deadline(timeoutMs));
  const error = await new Promise<grpc.ServiceError | undefined>((resolve) => {
    call.on("data", () => undefined);
    call.on("error", resolve);
    call.on("end", () => resolve(undefined));
  });
  report("error", error ? decodeError(error) : { code: "OK" });
}

async function main(): Promise<void> {
  const { values } = parseArgs({ options: {
    render: { type: "string", default: "127.0.0.1:50051" },
    engine: { type: "string", default: "127.0.0.1:50052" },
    derender: { type: "string", default: "127.0.0.1:50053" },
    image: { type: "string" },
    prompt: { type: "string", default: "What is in this picture?" },
    "max-tokens": { type: "string", default: "16" },
    "timeout-seconds": { type: "string", default: "60" },
  } });
  const addresses = { render: values.render!, engine: values.engine!, derender: values.derender! };
  const timeoutMs = Number(values["timeout-seconds"]) * 1000;
  const clients = connect(addresses);
  try {
    await health(addresses, timeoutMs);
    const vocabSize = await modelInfo(clients, timeoutMs);
    await structPitfall(clients, timeoutMs);
    if (values.image) {
      await imageChat(clients, values.prompt!, readFileSync(values.image), Number(values["max-tokens"]), timeoutMs);
    }
    await endStreamEarly(clients, "cancel", timeoutMs);
    await endStreamEarly(clients, "deadline", timeoutMs);
    await richError(clients, vocabSize, timeoutMs);
  } finally {
    closeAll(clients);
  }
}

main().catch((error) => {
  console.error(isServiceError(error) ? JSON.stringify(decodeError(error)) : error);
  process.exit(1);
});
