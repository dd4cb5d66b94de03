"""Settings from the environment, built on first use by a cached factory (never at import time)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MIN_ADMIN_KEY_LENGTH = 24


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DPLEDGER_", extra="ignore")

    database_url: str = Field(
        "sqlite:///./dpledger.db", validation_alias=AliasChoices("DATABASE_URL", "DPLEDGER_DATABASE_URL")
    )
    admin_key: str | None = None
    env: Literal["development", "production"] = "development"
    # The Ed25519 key that signs the transparency log's tree heads (service/ledger/signer.py): a PEM
    # file (`openssl genpkey -algorithm ed25519`), or the PEM text or 32-byte hex seed in the
    # environment. Never in the database: whoever can rewrite the database must not sign for it.
    signing_key_file: Path | None = None
    signing_key: SecretStr | None = None
    # How often the transparency log's sequencer looks for approved leaves (ledger/sequencer.py).
    log_sequence_interval_ms: int = Field(100, ge=1, le=60_000)

    @model_validator(mode="after")
    def _refuse_weak_admin_key(self) -> Settings:
        # A guessable bootstrap key would hand out every silo's budget; refuse it outside development.
        if self.env == "production" and self.admin_key is not None and len(self.admin_key) < MIN_ADMIN_KEY_LENGTH:
            raise ValueError(f"DPLEDGER_ADMIN_KEY must be at least {MIN_ADMIN_KEY_LENGTH} characters in production")
        return self

    @model_validator(mode="after")
    def _one_signing_key(self) -> Settings:
        if self.signing_key_file is not None and self.signing_key is not None:
            raise ValueError("set DPLEDGER_SIGNING_KEY_FILE or DPLEDGER_SIGNING_KEY, not both")
        # A key made up at start would sign heads no silo can tie to the last ones: receipts would
        # stop proving anything at every restart. Development may do that, with a warning.
        if self.env == "production" and self.signing_key_file is None and self.signing_key is None:
            raise ValueError("DPLEDGER_SIGNING_KEY_FILE (or DPLEDGER_SIGNING_KEY) is required in production: "
                             "the Ed25519 key that signs the transparency log")
        return self


@functools.lru_cache
def get_settings() -> Settings:
    return Settings()
