import pytest

from kiln.prep.base import Doc, StepContext
from kiln.prep.pii import PiiConfig, PiiRedact, card_ok, iban_ok, luhn_ok


def redact(text):
    step = PiiRedact()
    step.setup(StepContext())
    return step.redact(text)


@pytest.mark.parametrize("text, kind", [
    ("mail me at john.doe+news@example.co.uk today", "EMAIL"),
    ("server 192.168.1.10 is down", "IP_ADDRESS"),
    ("listen on 2001:db8:85a3::8a2e:370:7334 now", "IP_ADDRESS"),
    ("link-local fe80::1 address", "IP_ADDRESS"),
    ("call +1 415-555-0132 today", "PHONE_NUMBER"),
    ("call (415) 555-0132", "PHONE_NUMBER"),
    ("office +44 20 7946 0958", "PHONE_NUMBER"),
    ("card 4111 1111 1111 1111 expires", "CREDIT_CARD"),
    ("card 5500-0000-0000-0004", "CREDIT_CARD"),
    ("pay to GB82 WEST 1234 5698 7654 32 please", "IBAN"),
    ("iban DE89370400440532013000", "IBAN"),
    ("key AKIAIOSFODNN7EXAMPLE here", "SECRET"),
    ("token ghp_abcdefghijklmnopqrstuvwxyz0123456789", "SECRET"),
    ('api_key = "sk_live_abcdef123456"', "SECRET"),
    ("password=Xy7kq9Lm2Pz8Rt4W", "SECRET"),
    ("-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEA\n-----END RSA PRIVATE KEY-----", "PRIVATE_KEY"),
])
def test_redacts_positives(text, kind):
    out, counts = redact(text)
    assert counts == {kind: 1}
    assert f"<{kind}>" in out


@pytest.mark.parametrize("text", [
    "version 1.2.3.4 released", "v1.2.3.4", "Python 3.11.7", "on 2021-03-15 at 12:30:45",
    "pi is 3.14159265358979", "population 10.000.000 people", "ISBN 978-3-16-148410-0",
    "x[a::b] and std::vector", "numbers 1234 5678 9012 3456", "years 2019 2020 2021",
    "@decorator\ndef f(): pass", "password = get_password()", "token = None", "api_key = os.environ['KEY']",
    "order 12345678901234", "see section 1.2.3", "time 10:30", "DEAD::BEEF", "Copyright 1991-1995",
    "the uuid 123e4567-e89b-12d3-a456-426614174000", "hash 0x7fffffff", "GB82 is a code", "ratio 1:2:3",
    "ssh git@github", "call me at 5 pm", "mod 1000000007",
])
def test_keeps_tricky_negatives(text):
    assert redact(text) == (text, {})


def test_checksums():
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")
    assert card_ok("4111 1111 1111 1111") and not card_ok("1234 5678 9012 3456")
    assert iban_ok("GB82 WEST 1234 5698 7654 32") and not iban_ok("GB82 WEST 1234 5698 7654 33")


def test_step_counts_per_type_and_types_option():
    ctx = StepContext()
    step = PiiRedact(PiiConfig(types=["EMAIL"]))
    step.setup(ctx)
    docs = [Doc("a", "a@b.com and c@d.org at 10.0.0.1"), Doc("b", "nothing here")]
    out = list(step.run(iter(docs), ctx))
    assert out[0].text == "<EMAIL> and <EMAIL> at 10.0.0.1"
    assert ctx.stats["pii"]["modified"] == {"pii:EMAIL": 2}
    assert ctx.stats["pii"]["docs_modified"] == 1
    drop = PiiRedact(PiiConfig(drop_if_more_than=1))
    drop.setup(ctx)
    assert list(drop.run(iter([Doc("c", "x@y.com z@w.com")]), ctx)) == []
    assert ctx.stats["pii"]["dropped"] == {"pii:too_many": 1}
