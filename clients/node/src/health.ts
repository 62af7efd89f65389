// The standard gRPC health check (grpc.health.v1.Health/Check), which every tito service
// answers: NOT_SERVING until its model is loaded. The two tiny messages are declared inline, so
// no health.proto needs to be shipped.
import * as grpc from "@grpc/grpc-js";
import * as protobuf from "protobufjs";

const root = protobuf.Root.fromJSON({
  nested: {
    HealthCheckRequest: { fields: { service: { type: "string", id: 1 } } },
    HealthCheckResponse: {
      fields: { status: { type: "ServingStatus", id: 1 } },
      nested: { ServingStatus: { values: { UNKNOWN: 0, SERVING: 1, NOT_SERVING: 2, SERVICE_UNKNOWN: 3 } } },
    },
  },
});
const request = root.lookupType("HealthCheckRequest");
const response = root.lookupType("HealthCheckResponse");

// Resolve to "SERVING", "NOT_SERVING", ... for `service` ("" = the whole server).
export function checkHealth(address: string, service: string, deadlineMs: number): Promise<string> {
  const client = new grpc.Client(address, grpc.credentials.createInsecure());
  return new Promise((resolve, reject) => {
    client.makeUnaryRequest(
      "/grpc.health.v1.Health/Check",
      (message: object) => Buffer.from(request.encode(request.fromObject(message)).finish()),
      (bytes: Buffer) => response.toObject(response.decode(bytes), { enums: String, defaults: true }),
      { service },
      { deadline: Date.now() + deadlineMs },
      (error, reply) => {
        client.close();
        if (error) reject(error);
        else resolve((reply as { status: string }).status);
      },
    );
  });
}
