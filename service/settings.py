"""Settings from the environment, built on first use by a cached factory (never at import time)."""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MIN_ADMIN_KEY_LENGTH = 24


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DPLEDGER_", extra="ignore")

    database_url: str = Field(
        "sqlite:///./dpledger.db", validation_alias=AliasChoices("DATABASE_URL", "DPLEDGER_DATABASE_URL")
    )
    admin_key: str | None = None
    env: Literal["development", "production"] = "development"

    @model_validator(mode="after")
    def _refuse_weak_admin_key(self) -> Settings:
        # A guessable bootstrap key would hand out every silo's budget; refuse it outside development.
        if self.env == "production" and self.admin_key is not None and len(self.admin_key) < MIN_ADMIN_KEY_LENGTH:
            raise ValueError(f"DPLEDGER_ADMIN_KEY must be at least {MIN_ADMIN_KEY_LENGTH} characters in production")
        return self


@functools.lru_cache
def get_settings() -> Settings:
    return Settings()
