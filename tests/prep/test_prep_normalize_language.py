from kiln.prep.base import Doc, StepContext
from kiln.prep.language import ScriptConfig, ScriptFilter, UrlBlocklist, UrlBlocklistConfig, char_script
from kiln.prep.normalize import Normalize, NormalizeConfig


def test_normalize_nfc_whitespace_controls():
    step = Normalize()
    decomposed = "cafe\u0301"  # e + combining acute
    assert step.normalize(decomposed) == "caf\u00e9"
    assert step.normalize("a \t  b\u00a0c  \nnext\r\n\n\n\nend\x07\u200b  ") == "a b c\nnext\n\nend"
    assert Normalize(NormalizeConfig(max_blank_lines=0)).normalize("a\n\n\nb") == "a\nb"
    ctx = StepContext()
    out = list(step.run(iter([Doc("1", "ok"), Doc("2", " x "), Doc("3", " \u200b ")]), ctx))
    assert [d.text for d in out] == ["ok", "x"]
    assert ctx.stats["normalize"]["docs_modified"] == 2
    assert ctx.stats["normalize"]["dropped"] == {"normalize:empty": 1}


def test_char_script():
    assert char_script("a") == "LATIN" and char_script("é") == "LATIN"
    assert char_script("ж") == "CYRILLIC" and char_script("中") == "HAN" and char_script("α") == "GREEK"


def script_reason(text, **kw):
    step = ScriptFilter(ScriptConfig(**kw))
    step.setup(StepContext())
    return step.reason(Doc("d", text))


def test_script_filter():
    assert script_reason("Hello world, ça va?") is None
    assert script_reason("Привет, как дела? Всё хорошо.") == "script:cyrillic"
    assert script_reason("Привет", keep_scripts=["LATIN", "CYRILLIC"]) is None
    assert script_reason("hello 你好世界这是中文") == "script:han"
    assert script_reason("12345 !!!") == "script:no_letters"


def test_url_blocklist(tmp_path):
    listing = tmp_path / "domains.txt"
    listing.write_text("# spam\nbad.example\n", encoding="utf-8")
    step = UrlBlocklist(UrlBlocklistConfig(domains=["evil.com"], domains_file=str(listing), url_substrings=["/ads/"]))
    step.setup(StepContext())

    def reason(url):
        return step.reason(Doc("d", "text", {"url": url} if url else {}))

    assert reason("https://www.evil.com/page") == "url:blocked_domain"
    assert reason("http://bad.example:8080/x") == "url:blocked_domain"
    assert reason("https://notevil.com/") is None
    assert reason("https://ok.org/ads/1") == "url:blocked_substring"
    assert reason(None) is None
