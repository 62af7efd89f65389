// The three tito services from Node: render -> engine -> derender, streaming.
import * as grpc from "@grpc/grpc-js";
import { loadTito, ServiceClient } from "./protos";

export interface Addresses {
  render: string;
  engine: string;
  derender: string;
}

export interface Clients {
  render: ServiceClient;
  engine: ServiceClient;
  derender: ServiceClient;
}

// tito accepts messages up to 64 MiB by default (--max-message-bytes); rendered images carry
// their pixel tensors, so raise grpc-js's 4 MiB receive limit to match.
const CHANNEL_OPTIONS: grpc.ChannelOptions = { "grpc.max_receive_message_length": 64 * 1024 * 1024 };

export function connect(addresses: Addresses): Clients {
  const services = loadTito();
  const insecure = grpc.credentials.createInsecure(); // createSsl(...) for a server with --tls-cert-file
  return {
    render: new services.RenderService(addresses.render, insecure, CHANNEL_OPTIONS),
    engine: new services.EngineService(addresses.engine, insecure, CHANNEL_OPTIONS),
    derender: new services.DerenderService(addresses.derender, insecure, CHANNEL_OPTIONS),
  };
}

export function closeAll(clients: Clients): void {
  for (const client of Object.values(clients)) client.close();
}

// Every call gets a deadline: a call without one can wait forever on a stuck peer.
export function deadline(timeoutMs: number): grpc.CallOptions {
  return { deadline: Date.now() + timeoutMs };
}

export function unary<T = any>(client: ServiceClient, method: string, request: object, timeoutMs: number): Promise<T> {
  return new Promise((resolve, reject) => {
    client[method](request, deadline(timeoutMs), (error: grpc.ServiceError | null, reply: T) =>
      error ? reject(error) : resolve(reply));
  });
}

// One streamed chat: render it, stream the engine's tokens into derender, yield derender's chunks.
// When derender says cancel_generation (a stop string matched), the engine stream is cancelled:
// the engine frees the request at its next step. An engine error is raised as the engine's own
// status, not as the derender stream's.
export async function* streamChat(clients: Clients, request: object, timeoutMs: number): AsyncGenerator<any> {
  const rendered = await unary(clients.render, "RenderChat", request, timeoutMs);
  const generation: grpc.ClientReadableStream<any> = clients.engine.Generate(rendered.generate_request,
    deadline(timeoutMs));
  const derender: grpc.ClientDuplexStream<any, any> = clients.derender.Derender(deadline(timeoutMs));
  let engineError: grpc.ServiceError | undefined;
  derender.write({ context: rendered.derender_context }); // the context always goes first
  const endDerender = () => { if (!derender.writableEnded) derender.end(); };
  generation.on("data", (response) => {
    if (!derender.writableEnded) derender.write({ generate_response: response });
  });
  generation.on("end", endDerender);
  generation.on("error", (error: grpc.ServiceError) => {
    if (error.code === grpc.status.CANCELLED) return endDerender(); // we cancelled it
    engineError = error;
    derender.cancel();
  });
  try {
    for await (const reply of derender) {
      if (reply.chunk.cancel_generation) generation.cancel();
      yield reply.chunk;
    }
  } catch (error) {
    throw engineError ?? error;
  } finally {
    generation.cancel(); // no-op once it has ended
    derender.cancel();
  }
  if (engineError) throw engineError;
}
