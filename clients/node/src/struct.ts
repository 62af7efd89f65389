// google.protobuf.Struct from and to plain JSON.
//
// The pitfall: proto-loader (protobufjs) treats a Struct field like any other message, so a plain
// object such as {enable_thinking: false} given for chat_template_kwargs is read as a Struct
// whose (non-existent) field "enable_thinking" is ignored: the server receives an EMPTY Struct,
// silently. A Struct must be sent in its message shape, {fields: {name: Value}}, where each Value
// sets exactly one of nullValue, numberValue, stringValue, boolValue, structValue or listValue.
// toStruct builds that shape from plain JSON; fromStruct reads it back.
//
// The second pitfall: those Value members are camelCase even with keepCase: true, because
// protobufjs does not read google/protobuf/struct.proto but uses its own bundled copy, written
// in camelCase. {string_value: "x"} is dropped as an unknown field, so the key arrives as null.

export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

export interface Value {
  nullValue?: "NULL_VALUE";
  numberValue?: number;
  stringValue?: string;
  boolValue?: boolean;
  structValue?: Struct;
  listValue?: { values: Value[] };
}

export interface Struct {
  fields: { [key: string]: Value };
}

export function toValue(value: Json): Value {
  if (value === null) return { nullValue: "NULL_VALUE" };
  if (Array.isArray(value)) return { listValue: { values: value.map(toValue) } };
  switch (typeof value) {
    case "number":
      if (!Number.isFinite(value)) throw new TypeError(`a Struct cannot hold ${value}`);
      return { numberValue: value };
    case "string":
      return { stringValue: value };
    case "boolean":
      return { boolValue: value };
    case "object":
      return { structValue: toStruct(value) };
    default:
      throw new TypeError(`a Struct cannot hold a ${typeof value}`);
  }
}

export function toStruct(object: { [key: string]: Json }): Struct {
  const fields: { [key: string]: Value } = {};
  for (const [key, value] of Object.entries(object)) fields[key] = toValue(value);
  return { fields };
}

export function fromValue(value: Value): Json {
  if (value.structValue !== undefined) return fromStruct(value.structValue);
  if (value.listValue !== undefined) return (value.listValue.values ?? []).map(fromValue);
  if (value.numberValue !== undefined) return value.numberValue;
  if (value.stringValue !== undefined) return value.stringValue;
  if (value.boolValue !== undefined) return value.boolValue;
  return null;
}

export function fromStruct(struct: Struct): { [key: string]: Json } {
  const object: { [key: string]: Json } = {};
  for (const [key, value] of Object.entries(struct.fields ?? {})) object[key] = fromValue(value);
  return object;
}
