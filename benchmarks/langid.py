"""Offline language identification: py3langid (kiln's `language` step) vs lingua-language-detector
vs langdetect, accuracy and documents/s on a mixed-language sample.

    python benchmarks/langid.py [--wikitext ../shared/data/wikitext2-test.txt] [--en-docs 300]

The sample: English paragraphs from the shared wikitext file (lines over 200 characters) and, for
seven other languages, sentences written for this benchmark (five per language), used alone, joined in pairs
and triples, and cut to their first four words (short snippets separate the candidates). Each candidate sees the same texts, in the same
order, and the same language set (lingua is restricted to the sample's languages with its
default settings; py3langid and langdetect choose among all of theirs, the harder task).
Writes benchmarks/results/langid.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

SENTENCES = {
    "fr": ["Le marché ouvre tôt le samedi et les habitants y achètent des légumes frais.",
           "Nous avons visité le musée, puis nous avons déjeuné dans un petit restaurant près du port.",
           "La nouvelle loi sur l'énergie a été votée par le parlement après un long débat.",
           "Mon frère travaille comme ingénieur dans une entreprise qui construit des ponts.",
           "Il pleut souvent en automne, mais les forêts sont alors magnifiques."],
    "de": ["Der Markt öffnet am Samstag früh, und die Leute kaufen dort frisches Gemüse.",
           "Wir haben das Museum besucht und danach in einem kleinen Restaurant am Hafen gegessen.",
           "Das neue Energiegesetz wurde nach einer langen Debatte vom Parlament verabschiedet.",
           "Mein Bruder arbeitet als Ingenieur bei einer Firma, die Brücken baut.",
           "Im Herbst regnet es oft, aber die Wälder sind dann wunderschön."],
    "es": ["El mercado abre temprano los sábados y la gente compra verduras frescas.",
           "Visitamos el museo y después comimos en un pequeño restaurante cerca del puerto.",
           "La nueva ley de energía fue aprobada por el parlamento tras un largo debate.",
           "Mi hermano trabaja como ingeniero en una empresa que construye puentes.",
           "En otoño llueve a menudo, pero los bosques están preciosos."],
    "it": ["Il mercato apre presto il sabato e la gente compra verdura fresca.",
           "Abbiamo visitato il museo e poi abbiamo pranzato in un piccolo ristorante vicino al porto.",
           "La nuova legge sull'energia è stata approvata dal parlamento dopo un lungo dibattito.",
           "Mio fratello lavora come ingegnere in un'azienda che costruisce ponti.",
           "In autunno piove spesso, ma i boschi sono bellissimi."],
    "pt": ["O mercado abre cedo aos sábados e as pessoas compram legumes frescos.",
           "Visitámos o museu e depois almoçámos num pequeno restaurante perto do porto.",
           "A nova lei da energia foi aprovada pelo parlamento depois de um longo debate.",
           "O meu irmão trabalha como engenheiro numa empresa que constrói pontes.",
           "No outono chove muitas vezes, mas as florestas ficam lindas."],
    "nl": ["De markt gaat op zaterdag vroeg open en mensen kopen er verse groente.",
           "We hebben het museum bezocht en daarna gegeten in een klein restaurant bij de haven.",
           "De nieuwe energiewet is na een lang debat door het parlement aangenomen.",
           "Mijn broer werkt als ingenieur bij een bedrijf dat bruggen bouwt.",
           "In de herfst regent het vaak, maar de bossen zijn dan prachtig."],
    "ru": ["Рынок открывается рано по субботам, и люди покупают там свежие овощи.",
           "Мы посетили музей, а потом пообедали в маленьком ресторане у порта.",
           "Новый закон об энергетике был принят парламентом после долгих дебатов.",
           "Мой брат работает инженером в компании, которая строит мосты.",
           "Осенью часто идёт дождь, но леса тогда прекрасны."],
}


def build_sample(wikitext: Path, en_docs: int) -> list[tuple[str, str]]:
    sample = []
    for lang, sents in SENTENCES.items():
        for k in (1, 2, 3):
            sample += [(lang, " ".join(c)) for c in itertools.combinations(sents, k)]
        sample += [(lang, " ".join(sent.split()[:4])) for sent in sents]  # short snippets: the hard case
    lines = [ln.strip() for ln in wikitext.read_text(encoding="utf-8").splitlines() if len(ln.strip()) > 200]
    sample += [("en", ln) for ln in lines[:en_docs]]
    return sample


def candidates(langs: list[str]) -> dict:
    out = {}
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    out["py3langid"] = lambda text: ident.classify(text)[0]
    try:
        from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

        chosen = [Language.from_iso_code_639_1(getattr(IsoCode639_1, code.upper())) for code in langs]
        detector = LanguageDetectorBuilder.from_languages(*chosen).build()
        out["lingua (sample languages)"] = lambda text: (
            lambda r: r.iso_code_639_1.name.lower() if r else "und")(detector.detect_language_of(text))
    except ImportError:
        print("lingua-language-detector not installed: skipped")
    try:
        import langdetect

        langdetect.DetectorFactory.seed = 0
        out["langdetect"] = lambda text: langdetect.detect(text)
    except ImportError:
        print("langdetect not installed: skipped")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wikitext", default=str(Path(__file__).resolve().parents[2] / "shared/data/wikitext2-test.txt"))
    parser.add_argument("--en-docs", type=int, default=300)
    args = parser.parse_args()
    sample = build_sample(Path(args.wikitext), args.en_docs)
    langs = sorted({lang for lang, _ in sample})
    rows = {}
    for name, classify in candidates(langs).items():
        classify(sample[0][1])  # load lazily built models outside the timing
        t0 = time.perf_counter()
        predictions = [classify(text) for _, text in sample]
        seconds = time.perf_counter() - t0
        correct = [p == lang for p, (lang, _) in zip(predictions, sample)]
        per_lang = {lang: round(sum(c for c, (lg, _) in zip(correct, sample) if lg == lang) /
                                sum(1 for lg, _ in sample if lg == lang), 3) for lang in langs}
        rows[name] = {"accuracy": round(sum(correct) / len(sample), 4), "docs_per_s": round(len(sample) / seconds, 1),
                      "by_language": per_lang}
        print(f"{name:28s} accuracy {rows[name]['accuracy']:.4f}  {rows[name]['docs_per_s']:8.1f} docs/s  {per_lang}")
    result = {"command": " ".join(sys.argv), "docs": len(sample), "languages": langs, "results": rows}
    out = Path(__file__).parent / "results" / "langid.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
