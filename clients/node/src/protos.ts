// Loading the tito contract at run time with @grpc/proto-loader (no code generation step).
//
// The choices below decide how every message looks in JavaScript; README.md explains each one.
import * as path from "path";
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import * as protobuf from "protobufjs";

// The repository's proto/ directory: tito/v1/*.proto and the vendored google/rpc/*.proto.
// google/protobuf/*.proto (Struct, Any, Duration) come bundled with protobufjs.
export const PROTO_ROOT = process.env.TITO_PROTO_ROOT ?? path.resolve(__dirname, "..", "..", "..", "proto");

const TITO_FILES = ["tito/v1/render.proto", "tito/v1/engine.proto", "tito/v1/derender.proto"];
const RPC_FILES = ["google/rpc/status.proto", "google/rpc/error_details.proto"];

export const LOADER_OPTIONS: protoLoader.Options = {
  keepCase: true, // field names exactly as in the .proto (snake_case), as in tito's docs and JSON
  longs: String, // uint64/int64 arrive as decimal strings: exact beyond 2^53 (send strings or numbers)
  enums: String, // enums arrive as their names, e.g. "FINISH_REASON_STOP" (send names or numbers)
  bytes: Buffer, // bytes arrive as Buffers
  defaults: false, // unset fields stay absent, so a message forwarded as-is keeps what was set
  arrays: true, // ... but repeated fields are always arrays
  objects: true, // ... and map fields always objects
  oneofs: true, // a oneof's name holds which member is set, e.g. part.part === "image"
  includeDirs: [PROTO_ROOT],
};

// Service constructors, typed loosely: proto-loader builds them at run time.
export type ServiceClient = grpc.Client & Record<string, Function>;
type ServiceConstructor = new (address: string, credentials: grpc.ChannelCredentials,
                               options?: grpc.ChannelOptions) => ServiceClient;

export interface TitoServices {
  RenderService: ServiceConstructor;
  EngineService: ServiceConstructor;
  DerenderService: ServiceConstructor;
}

export function loadTito(): TitoServices {
  const definition = protoLoader.loadSync(TITO_FILES, LOADER_OPTIONS);
  const loaded = grpc.loadPackageDefinition(definition) as any;
  return loaded.tito.v1 as TitoServices;
}

// protobufjs types for messages that travel outside a method's request or response: the
// google.rpc.Status in the grpc-status-details-bin trailer and the details packed in it.
let rpcRoot: protobuf.Root | undefined;

export function rpcTypes(): protobuf.Root {
  if (!rpcRoot) {
    const root = new protobuf.Root();
    root.resolvePath = (_origin, target) => path.join(PROTO_ROOT, target);
    rpcRoot = root.loadSync(RPC_FILES, { keepCase: true });
  }
  return rpcRoot;
}

export const TO_OBJECT: protobuf.IConversionOptions = {
  longs: String, enums: String, bytes: String, defaults: true, arrays: true, objects: true, oneofs: true,
};
