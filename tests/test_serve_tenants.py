"""``lattice serve`` keeps one suffix index per tenant: a tenant drafts from its own earlier requests, never from
another tenant's (API key, or scope under a key), unless the operator shares them; clearing works."""

from __future__ import annotations

import pytest

from lattice_inference.errors import ConfigError
from lattice_inference.options import DecodeOptions
from lattice_inference.serve.tenants import SHARED, SuffixScopes, tenant_of

from .serve_harness import PROMPTS, load_tiny, request, running_server

BUDGET = 40


def test_tenants_are_keys_and_scopes_under_them():
    assert tenant_of("tenant", None, None) == tenant_of("tenant", None, None)  # a keyless server: one user
    assert tenant_of("tenant", None, None) not in (None, tenant_of("tenant", "k1", None))
    assert tenant_of("tenant", "k1", None) != tenant_of("tenant", "k2", None)
    assert tenant_of("tenant", "k1", "x") != tenant_of("tenant", "k2", "x")  # a scope lives under its key
    assert tenant_of("tenant", "k1", "x") != tenant_of("tenant", "k1", None)
    assert tenant_of("tenant", None, "x") == tenant_of("tenant", None, "x")
    assert "k1" not in tenant_of("tenant", "k1", "x")  # the key is not kept
    assert tenant_of("shared", "k1", "x") == tenant_of("shared", None, None) == SHARED
    assert tenant_of("request", "k1", "x") is None


def test_scopes_stay_under_one_budget_least_recently_used_first():
    scopes = SuffixScopes(100)
    a = scopes.index_for("a")
    a.begin(range(60))
    b = scopes.index_for("b")
    b.begin(range(30))
    assert scopes.index_for("a") is a and scopes.tenants == 2 and len(scopes) == 90
    c = scopes.index_for("c")  # a was used after b: b goes once the total passes the budget
    c.begin(range(20))
    assert scopes.index_for("c") is c and scopes.tenants == 2 and scopes.index_for("a") is a
    assert len(scopes) <= 100
    private = scopes.index_for(None)
    assert private is not scopes.index_for(None) and len(private) == 0
    scopes.clear("a")
    assert len(scopes.index_for("a")) == 0
    with pytest.raises(ConfigError, match="--suffix-scope"):
        SuffixScopes(10, "everyone")


@pytest.fixture(scope="module")
def loaded():
    return load_tiny()


def complete(base: str, key: str, **speculative: object) -> tuple[str, int]:
    spec = {"adaptive": False, **speculative}  # every proposal verified: forward counts depend on drafts alone
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": BUDGET, "speculative": spec}
    answer = request(base, "POST", "/v1/completions", body, headers={"authorization": f"Bearer {key}"})
    assert answer.status_code == 200, answer.text
    out = answer.json()
    assert out["usage"]["completion_tokens"] > 10
    return out["choices"][0]["text"], out["speculative_metrics"]["target_forwards"]


def test_one_tenant_never_drafts_from_another(loaded):
    with running_server(loaded, method="suffix", api_key=["alice", "bob"]) as (base, app):
        text, alone = complete(base, "alice")
        assert complete(base, "bob") == (text, alone)  # bob's first request: alice's is not his
        again_text, again = complete(base, "alice")
        assert again_text == text and again < alone  # alice drafts from her own earlier request
        assert complete(base, "alice", scope="x") == (text, alone)  # a fresh scope of hers
        assert complete(base, "bob", scope="x") == (text, alone)  # bob's "x" is not alice's
        assert complete(base, "bob", scope="x")[1] < alone
        assert complete(base, "alice", clear_index=True) == (text, alone)
        assert app.state.server.engine.suffix_scopes.tenants == 4
        assert complete(base, "alice", method="ngram")[0] == text  # other methods ignore the scope


def test_without_keys_requests_are_one_users_unless_isolated(loaded):
    """A server without keys has one user: its requests draft from each other (a scope still starts fresh);
    ``--suffix-scope request`` shares nothing."""
    with running_server(loaded, method="suffix") as (base, _):
        text, alone = complete(base, "none")
        again_text, again = complete(base, "none")
        assert again_text == text and again < alone
        assert complete(base, "none", scope="team") == (text, alone)
        assert complete(base, "none", scope="team")[1] < alone
    with running_server(loaded, method="suffix", suffix_scope="request") as (base, _):
        text, alone = complete(base, "none")
        assert complete(base, "none") == (text, alone)


def test_the_planners_learned_acceptance_stays_within_a_tenant(loaded):
    """The draft planner's acceptance rates, carried from one request to the next, are kept per tenant (as the
    suffix index): a tenant's first request never starts from another's, and clearing forgets them too."""
    with running_server(loaded, method="ngram", api_key=["alice", "bob"]) as (base, app):
        alice, bob = tenant_of("tenant", "alice", None), tenant_of("tenant", "bob", None)
        text, _ = complete(base, "alice", adaptive=True)
        decoder = app.state.server.engine.generator(DecodeOptions(method="ngram")).decoder
        learned = decoder.learned(alice)
        assert learned is not None and decoder.learned(bob) is None and decoder.learned() is None
        assert complete(base, "bob", adaptive=True)[0] == text
        assert decoder.learned(bob) not in (None, learned) and decoder.learned(alice) is learned
        complete(base, "alice", adaptive=True, clear_index=True)
        assert decoder.learned(alice) not in (None, learned)  # forgotten, then learned from this request alone
        assert decoder.learned() is None  # nothing outside the tenants
