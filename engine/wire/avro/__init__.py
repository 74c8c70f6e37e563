"""The Avro machinery under ``engine.wire.serde``: binary primitives, the schema files,
the map from record classes onto schemas, the compiled encode and decode plans, and the
conversion to and from fastavro's dicts for what the plans do not cover."""
