// tito's rich errors: a google.rpc.Status in the grpc-status-details-bin trailer, carrying an
// ErrorInfo (reason, domain "tito.dev", metadata) and, for bad fields, a BadRequest naming each
// field as a path such as "messages[0].content_parts[1].image" or "token_ids[1]".
import * as grpc from "@grpc/grpc-js";
import { rpcTypes, TO_OBJECT } from "./protos";

export interface FieldViolation {
  field: string;
  description: string;
}

export interface TitoError {
  code: string; // the status code's name, e.g. "INVALID_ARGUMENT"
  message: string;
  reason?: string; // ErrorInfo.reason, e.g. "TOKEN_ID_OUT_OF_RANGE"
  domain?: string; // ErrorInfo.domain: "tito.dev"
  metadata?: { [key: string]: string };
  fieldViolations: FieldViolation[]; // BadRequest.field_violations
  otherDetails: string[]; // type URLs of details this client does not decode
}

const TYPE_URL_PREFIX = "type.googleapis.com/";

export function isServiceError(error: unknown): error is grpc.ServiceError {
  return error instanceof Error && typeof (error as grpc.ServiceError).code === "number";
}

// Decode an error from a call (unary callback error or stream "error" event).
export function decodeError(error: grpc.ServiceError): TitoError {
  const decoded: TitoError = {
    code: grpc.status[error.code] ?? String(error.code),
    message: error.details,
    fieldViolations: [],
    otherDetails: [],
  };
  const raw = error.metadata?.get("grpc-status-details-bin")[0];
  if (!(raw instanceof Buffer)) return decoded; // no rich status (e.g. CANCELLED, DEADLINE_EXCEEDED)
  const root = rpcTypes();
  const status = root.lookupType("google.rpc.Status").decode(raw) as any;
  for (const detail of status.details ?? []) {
    const typeName = String(detail.type_url).slice(TYPE_URL_PREFIX.length);
    if (typeName === "google.rpc.ErrorInfo") {
      const info = root.lookupType(typeName).toObject(root.lookupType(typeName).decode(detail.value), TO_OBJECT);
      Object.assign(decoded, { reason: info.reason, domain: info.domain, metadata: info.metadata });
    } else if (typeName === "google.rpc.BadRequest") {
      const type = root.lookupType(typeName);
      const badRequest = type.toObject(type.decode(detail.value), TO_OBJECT);
      for (const violation of badRequest.field_violations) {
        decoded.fieldViolations.push({ field: violation.field, description: violation.description });
      }
    } else {
      decoded.otherDetails.push(detail.type_url);
    }
  }
  return decoded;
}
