// node --test dist/struct.test.js: toStruct / fromStruct against the real protobufjs encoding of
// google.protobuf.Struct, as proto-loader uses it.
import { test } from "node:test";
import * as assert from "node:assert/strict";
import * as protobuf from "protobufjs";
import { fromStruct, Json, toStruct } from "./struct";

const Struct = protobuf.Root.fromJSON(protobuf.common.get("google/protobuf/struct.proto")!)
  .lookupType("google.protobuf.Struct");

function roundTrip(object: { [key: string]: Json }): { [key: string]: Json } {
  const bytes = Struct.encode(Struct.fromObject(toStruct(object))).finish();
  return fromStruct(Struct.toObject(Struct.decode(bytes), { enums: String, oneofs: true }) as any);
}

test("every JSON kind survives the wire", () => {
  const object = { text: "x", number: 1.5, negative: -3, yes: true, no: false, nothing: null,
                   list: [1, "two", [3], { four: 4 }], nested: { deeper: { deepest: [] } }, empty: {} };
  assert.deepEqual(roundTrip(object), object);
});

test("a plain object given as a Struct is dropped: the pitfall toStruct avoids", () => {
  const bytes = Struct.encode(Struct.fromObject({ enable_thinking: false })).finish();
  assert.equal(bytes.length, 0);
});

test("snake_case Value members are dropped too: protobufjs' bundled Struct is camelCase", () => {
  const bytes = Struct.encode(Struct.fromObject({ fields: { a: { string_value: "x" } } })).finish();
  assert.deepEqual(fromStruct(Struct.toObject(Struct.decode(bytes)) as any), { a: null });
});

test("values JSON cannot hold are refused", () => {
  assert.throws(() => toStruct({ bad: Number.NaN }), TypeError);
  assert.throws(() => toStruct({ bad: undefined as unknown as Json }), TypeError);
});
