"""The base of every recipe model: unknown fields, loose types and non-finite floats are errors (the
invariants in zrl/config/schema.py)."""

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)
