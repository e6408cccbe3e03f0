// A small Markdown renderer that builds DOM nodes: every piece of text goes in through
// textContent or a text node, never innerHTML, so "<script>" or "<img onerror=...>" in a
// model's answer stays text. Covers what chat models write: paragraphs, headings, fenced code,
// lists, quotes, tables, rules, and inline code, bold, italic, strike-through and links.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const INLINE = new RegExp([
  /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/.source,  // 1, 2: code
  /\*\*(?=\S)([\s\S]*?\S)\*\*/.source,  // 3: bold
  /(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)/.source,  // 4: bold
  /\*(?=[^\s*])([\s\S]*?[^\s*])\*/.source,  // 5: italic
  /(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/.source,  // 6: italic
  /~~(?=\S)([\s\S]*?\S)~~/.source,  // 7: strike-through
  /\[([^\]\n]+)\]\(\s*<?([^)\s>]+)>?\s*\)/.source,  // 8, 9: link
  /(https?:\/\/[^\s<>()]*[^\s<>().,;:!?'"])/.source,  // 10: bare address
].join("|"), "g");
const SAFE_LINK = /^(https?:|mailto:)/i;

export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  appendBlocks(fragment, text.replace(/\r\n?/g, "\n").split("\n"));
  return fragment;
}

function appendBlocks(parent, lines) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let match;
    if (!line.trim()) {
      i += 1;
    } else if ((match = FENCE.exec(line))) {
      i = appendCode(parent, lines, i, match[1], match[2]);
    } else if ((match = HEADING.exec(line))) {
      parent.append(element(`h${match[1].length}`, inline(match[2])));
      i += 1;
    } else if (RULE.test(line)) {
      parent.append(document.createElement("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const quoted = takeWhile(lines, i, (l) => QUOTE.test(l));
      const quote = document.createElement("blockquote");
      appendBlocks(quote, quoted.map((l) => l.replace(QUOTE, "")));
      parent.append(quote);
      i += quoted.length;
    } else if (ITEM.test(line)) {
      i = appendList(parent, lines, i);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      i = appendTable(parent, lines, i);
    } else {
      const paragraph = takeWhile(lines, i, (l, k) => k === i || (l.trim() && !startsBlock(l)));
      const p = document.createElement("p");
      paragraph.forEach((l, k) => p.append(...(k ? [document.createElement("br")] : []), ...inline(l.trim())));
      parent.append(p);
      i += paragraph.length;
    }
  }
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

function takeWhile(lines, start, keep) {
  let end = start;
  while (end < lines.length && keep(lines[end], end)) end += 1;
  return lines.slice(start, end);
}

function appendCode(parent, lines, start, fence, language) {
  let end = start + 1;
  while (end < lines.length && !lines[end].trim().startsWith(fence)) end += 1;
  const code = element("code", [lines.slice(start + 1, end).join("\n")]);
  if (language) code.dataset.language = language;
  const block = document.createElement("div");
  block.className = "code-block";
  const bar = element("div", [language || "code"]);
  bar.className = "code-bar";
  const copy = element("button", ["Copy"]);
  copy.type = "button";
  copy.className = "copy";
  // navigator.clipboard exists in secure contexts only (not a LAN address over plain HTTP).
  copy.addEventListener("click", () => (navigator.clipboard?.writeText(code.textContent) ?? Promise.reject()).then(
    () => { copy.textContent = "Copied"; }, () => { copy.textContent = "Copy failed"; }));
  bar.append(copy);
  block.append(bar, element("pre", [code]));
  parent.append(block);
  return end + 1;  // past the closing fence; an unclosed one (still streaming) runs to the end
}

function appendList(parent, lines, start) {
  const first = ITEM.exec(lines[start]);
  const ordered = /\d/.test(first[2]);
  const list = document.createElement(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  const indent = first[1].length;
  let i = start;
  while (i < lines.length) {
    const item = ITEM.exec(lines[i]);
    if (!item || item[1].length !== indent || /\d/.test(item[2]) !== ordered) break;
    const body = [item[3]];
    i += 1;
    while (i < lines.length && (lines[i].match(/^\s*/)[0].length > indent || (!lines[i].trim()
           && i + 1 < lines.length && lines[i + 1].match(/^\s*/)[0].length > indent))) {
      body.push(lines[i].slice(Math.min(indent + 2, lines[i].match(/^\s*/)[0].length)));
      i += 1;
    }
    const li = document.createElement("li");
    if (body.length === 1) li.append(...inline(body[0]));
    else appendBlocks(li, body);
    list.append(li);
  }
  parent.append(list);
  return i;
}

function appendTable(parent, lines, start) {
  const cells = (line) => line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
  const table = document.createElement("table");
  const header = element("tr", cells(lines[start]).map((c) => element("th", inline(c))));
  table.append(element("thead", [header]));
  const rows = takeWhile(lines, start + 2, (l) => l.includes("|") && l.trim());
  table.append(element("tbody", rows.map((row) => element("tr", cells(row).map((c) => element("td", inline(c)))))));
  const scroller = element("div", [table]);
  scroller.className = "table";
  parent.append(scroller);
  return start + 2 + rows.length;
}

function inline(text) {
  const nodes = [];
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) nodes.push(text.slice(last, match.index));
    nodes.push(inlineNode(match));
    last = match.index + match[0].length;
  }
  if (last < text.length) nodes.push(text.slice(last));
  return nodes;
}

function inlineNode(match) {
  if (match[2] !== undefined) return element("code", [match[2].replace(/^ (.+) $/, "$1")]);
  if (match[3] !== undefined || match[4] !== undefined) return element("strong", inline(match[3] ?? match[4]));
  if (match[5] !== undefined || match[6] !== undefined) return element("em", inline(match[5] ?? match[6]));
  if (match[7] !== undefined) return element("del", inline(match[7]));
  if (match[8] !== undefined) return link(match[9], inline(match[8]), match[0]);
  return link(match[10], [match[10]], match[10]);
}

function link(address, children, asText) {
  if (!SAFE_LINK.test(address)) return asText;  // javascript:, data: and the like stay text
  const a = element("a", children);
  a.href = address;
  a.rel = "noopener noreferrer";
  a.target = "_blank";
  return a;
}

function element(tag, children) {
  const node = document.createElement(tag);
  node.append(...children);  // strings become text nodes
  return node;
}
