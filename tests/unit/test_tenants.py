import pytest

from serve_app.contract import Priority
from serve_app.errors import RateLimited, Unauthorized
from serve_app.scheduling.tenants import Tenant, TenantRegistry, TokenBucket, key_digest, resolve_key
from tests.unit.fakes import Clock


def test_bucket_allows_a_burst_then_the_rate():
    clock = Clock()
    bucket = TokenBucket(rate_per_s=2, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0, 0, 0]
    assert bucket.take() == pytest.approx(0.5)
    clock.now = 0.5
    assert bucket.take() == 0
    clock.now = 100
    assert [bucket.take() for _ in range(4)][-1] > 0  # saved tokens never exceed the burst


def test_open_registry_without_keys():
    reg = TenantRegistry([])
    assert reg.open and reg.authenticate(None).name == "anonymous"


def test_keys_map_to_tenants_and_bad_keys_are_401():
    gold = Tenant("gold", digests=[key_digest("k-gold")])
    free = Tenant("free", Priority.LOW, digests=[key_digest("k-free")])
    reg = TenantRegistry([gold, free])
    assert reg.authenticate("Bearer k-gold") is gold
    assert reg.authenticate("bearer  k-free ") is free
    for bad in (None, "", "Bearer", "Basic k-gold", "Bearer nope"):
        with pytest.raises(Unauthorized):
            reg.authenticate(bad)


def test_priority_ceiling_caps_what_a_tenant_asks_for():
    free = Tenant("free", Priority.LOW)
    assert free.cap(Priority.HIGH) is Priority.LOW
    assert Tenant("std", Priority.NORMAL).cap(Priority.LOW) is Priority.LOW


def test_rate_limit_is_a_429_with_retry_after():
    t = Tenant("t", bucket=TokenBucket(1, 1, clock=Clock()))
    t.admit()
    with pytest.raises(RateLimited) as e:
        t.admit()
    assert e.value.status_code == 429 and e.value.retry_after_s == pytest.approx(1)


def test_keys_come_hashed_from_config_env_or_file(tmp_path, monkeypatch):
    digest = key_digest("s3cret")
    assert resolve_key(digest.hex(), None, None) == digest
    monkeypatch.setenv("TEAM_KEY", "s3cret\n")
    assert resolve_key(None, "TEAM_KEY", None) == digest
    (tmp_path / "key").write_text("s3cret\n")
    assert resolve_key(None, None, str(tmp_path / "key")) == digest
    with pytest.raises(ValueError, match="not set"):
        resolve_key(None, "MISSING_KEY_VAR", None)
    with pytest.raises(ValueError, match="64 hex"):
        resolve_key("abcd", None, None)


def test_without_keys_anonymous_callers_are_capped_at_normal_unless_configured():
    from serve_app.router.admission.callers import build_registry

    capped = build_registry([]).authenticate(None)
    assert capped.cap(Priority.HIGH) == Priority.NORMAL and capped.cap(Priority.LOW) == Priority.LOW
    trusted = build_registry([], anonymous_max_priority="high").authenticate(None)
    assert trusted.cap(Priority.HIGH) == Priority.HIGH


def test_a_router_built_from_a_config_without_tenants_caps_anonymous_callers_at_normal(tiny_model_dir):
    """The config's default and the router's wiring, not only the registry's own default."""
    from serve_app.config import AppArgs
    from serve_app.router.parts import build_parts
    from tests.conftest import tiny_args

    parts = build_parts(AppArgs.model_validate(tiny_args(tiny_model_dir)), {}, "r", lambda model: None)  # type: ignore[arg-type,return-value]
    anonymous = parts.callers.authenticate(None)
    assert anonymous.cap(Priority.HIGH) == Priority.NORMAL


def test_a_request_is_charged_one_token_per_item_at_most_the_burst():
    clock = Clock()
    t = Tenant("t", bucket=TokenBucket(rate_per_s=1, burst=4, clock=clock))
    t.admit(3)
    with pytest.raises(RateLimited) as refused:
        t.admit(2)  # one token left
    assert refused.value.retry_after_s == pytest.approx(1.0)
    clock.now = 10
    t.admit(64)  # more items than the burst: charged the whole burst, never refused forever
    with pytest.raises(RateLimited):
        t.admit()
    t.admit(0)  # nothing more to charge


def test_a_request_with_more_rows_than_the_burst_passes_once_the_bucket_is_full():
    """The router charges one token on arrival and the rest once it has read the body: the two
    together take at most the burst, or a request with more rows could never pass."""
    clock = Clock()
    t = Tenant("t", bucket=TokenBucket(rate_per_s=10, burst=20, clock=clock))
    t.admit()  # on arrival
    t.admit(64, charged=1)  # 64 rows: the whole burst in all
    with pytest.raises(RateLimited):
        t.admit()
    clock.now = 2.0  # the bucket is full again
    t.admit()
    t.admit(21, charged=1)
    assert t.bucket is not None and t.bucket.tokens == 0


def test_each_router_replica_holds_its_share_of_a_tenants_rate():
    clock = Clock()
    bucket = TokenBucket(rate_per_s=4, burst=8, clock=clock)
    registry = TenantRegistry([Tenant("t", bucket=bucket, digests=[key_digest("k")])])
    registry.set_share(4)  # four router replicas: each lets through a quarter
    assert (bucket.rate, bucket.burst) == (1.0, 2.0)
    assert [bucket.take() for _ in range(3)] == [0, 0, pytest.approx(1.0)]
    registry.set_share(1)
    clock.now = 10
    assert (bucket.rate, bucket.burst) == (4.0, 8.0) and bucket.take(8) == 0
    registry.set_share(100)  # never below one token of burst, or nothing could pass
    assert bucket.burst == 1.0
