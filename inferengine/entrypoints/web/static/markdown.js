// A small Markdown renderer for model replies. It builds DOM nodes and sets only textContent
// and vetted attributes: model output never reaches innerHTML, so "<script>" is shown as text.
// Blocks: paragraphs, headings, fenced code, lists (nested), quotes, tables, rules.
// Inline: code spans, bold, italic, strikethrough, links (http, https, mailto only), escapes.
// An unclosed fence (a reply still streaming) runs to the end of the text.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^\s`]*)/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const SAFE_PROTOCOLS = new Set(["http:", "https:", "mailto:"]);

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

/** The Markdown `source` as a DocumentFragment of safe DOM nodes. */
export function renderMarkdown(source) {
  const fragment = document.createDocumentFragment();
  renderBlocks(String(source ?? "").replace(/\r\n?/g, "\n").split("\n"), fragment);
  return fragment;
}

function startsBlock(line, next) {
  return (
    FENCE.test(line) ||
    HEADING.test(line) ||
    RULE.test(line) ||
    QUOTE.test(line) ||
    ITEM.test(line) ||
    (line.includes("|") && next !== undefined && TABLE_RULE.test(next) && next.includes("-"))
  );
}

function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i += 1;
      continue;
    }
    let m;
    if ((m = FENCE.exec(line))) {
      i = codeBlock(lines, i, m, parent);
    } else if ((m = HEADING.exec(line))) {
      const h = el(`h${m[1].length}`);
      renderInline(m[2], h);
      parent.append(h);
      i += 1;
    } else if (RULE.test(line)) {
      parent.append(el("hr"));
      i += 1;
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        inner.push(m[1]);
        i += 1;
      }
      const quote = el("blockquote");
      renderBlocks(inner, quote);
      parent.append(quote);
    } else if (ITEM.test(line)) {
      i = list(lines, i, parent);
    } else if (startsBlock(line, lines[i + 1])) {
      i = table(lines, i, parent);
    } else {
      const text = [line];
      i += 1;
      while (i < lines.length && lines[i].trim() && !startsBlock(lines[i], lines[i + 1])) {
        text.push(lines[i]);
        i += 1;
      }
      const p = el("p");
      renderInline(text.map((t) => t.trim()).join("\n"), p);
      parent.append(p);
    }
  }
}

function codeBlock(lines, start, match, parent) {
  const fence = match[1];
  const body = [];
  let i = start + 1;
  while (i < lines.length) {
    const close = lines[i].trim();
    if (close.startsWith(fence) && /^[`~]+$/.test(close) && close[0] === fence[0]) {
      i += 1;
      break;
    }
    body.push(lines[i]);
    i += 1;
  }
  const pre = el("pre", "code-block");
  const code = el("code", match[2] ? `language-${match[2].replace(/[^\w+#.-]/g, "")}` : "");
  code.textContent = body.join("\n");
  if (match[2]) pre.dataset.lang = match[2].slice(0, 20);
  pre.append(code);
  parent.append(pre);
  return i;
}

function list(lines, start, parent) {
  const first = ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  let i = start;
  let item = null;
  let blankBefore = false;
  while (i < lines.length) {
    const line = lines[i];
    const m = ITEM.exec(line);
    if (m && m[1].length === indent && /\d/.test(m[2]) === ordered) {
      if (item) addItem(node, item);
      item = [m[3]];
      blankBefore = false;
    } else if (!line.trim()) {
      blankBefore = true;
      item.push("");
    } else if (line.search(/\S/) > indent) {
      item.push(line.slice(Math.min(line.search(/\S/), indent + first[2].length + 1)));
      blankBefore = false;
    } else if (!blankBefore && !startsBlock(line, lines[i + 1])) {
      item.push(line.trim()); // a lazy continuation of the item's paragraph
    } else {
      break;
    }
    i += 1;
  }
  if (item) addItem(node, item);
  parent.append(node);
  while (i > start && !lines[i - 1].trim()) i -= 1; // trailing blanks end the list
  return i;
}

function addItem(listNode, itemLines) {
  const li = el("li");
  while (itemLines.length && !itemLines[itemLines.length - 1].trim()) itemLines.pop();
  const task = /^\[([ xX])\]\s+/.exec(itemLines[0] || "");
  if (task) {
    const box = el("input");
    box.type = "checkbox";
    box.disabled = true;
    box.checked = task[1] !== " ";
    li.append(box, " ");
    itemLines[0] = itemLines[0].slice(task[0].length);
  }
  renderBlocks(itemLines, li);
  if (li.childElementCount === 1 && li.firstElementChild.tagName === "P") {
    li.firstElementChild.replaceWith(...li.firstElementChild.childNodes); // a tight item
  }
  listNode.append(li);
}

function cells(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function table(lines, start, parent) {
  const head = cells(lines[start]);
  const align = cells(lines[start + 1]).map((c) =>
    c.endsWith(":") ? (c.startsWith(":") ? "center" : "right") : c.startsWith(":") ? "left" : "",
  );
  const wrap = el("div", "table-wrap");
  const tableNode = el("table");
  const row = (values, tag) => {
    const tr = el("tr");
    head.forEach((_, k) => {
      const cell = el(tag);
      if (align[k]) cell.style.textAlign = align[k];
      renderInline(values[k] ?? "", cell);
      tr.append(cell);
    });
    return tr;
  };
  const thead = el("thead");
  thead.append(row(head, "th"));
  const tbody = el("tbody");
  let i = start + 2;
  while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
    tbody.append(row(cells(lines[i]), "td"));
    i += 1;
  }
  tableNode.append(thead, tbody);
  wrap.append(tableNode);
  parent.append(wrap);
  return i;
}

// One pass over the text; each alternative is one inline construct (group numbers below).
const INLINE = new RegExp(
  [
    /\\([\\`*_{}[\]()#+\-.!~|<>])/, // 1: an escaped character
    /(`+)([^`]|[^`][\s\S]*?[^`])\2(?!`)/, // 2, 3: a code span
    /\*\*(?=\S)([\s\S]*?\S)\*\*/, // 4: bold
    /__(?=\S)([\s\S]*?\S)__(?!\w)/, // 5: bold
    /~~(?=\S)([\s\S]*?\S)~~/, // 6: strikethrough
    /\*(?=[^\s*])([\s\S]*?[^\s*])\*/, // 7: italic
    /(?<![\w])_(?=[^\s_])([\s\S]*?[^\s_])_(?![\w])/, // 8: italic
    /\[([^\]\n]+)\]\(\s*<?((?:[^\s<>()]|\([^\s<>()]*\))+)>?(?:\s+"[^"\n]*")?\s*\)/, // 9, 10: a link
    /<((?:https?|mailto):[^\s<>]+)>/, // 11: an autolink
    /(https?:\/\/[^\s<>()]*[^\s<>().,:;!?"'\]])/, // 12: a bare URL
  ]
    .map((r) => r.source)
    .join("|"),
  "g",
);

function safeHref(url) {
  try {
    const parsed = new URL(url, window.location.href);
    return SAFE_PROTOCOLS.has(parsed.protocol) ? parsed.href : null;
  } catch {
    return null;
  }
}

function link(label, url, parent, plain) {
  const href = safeHref(url);
  if (href === null) {
    parent.append(document.createTextNode(label));
    return;
  }
  const a = el("a");
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  if (plain) a.textContent = label; // a URL shown as itself
  else renderInline(label, a);
  parent.append(a);
}

function text(value, parent) {
  value.split("\n").forEach((part, k) => {
    if (k) parent.append(el("br"));
    if (part) parent.append(document.createTextNode(part));
  });
}

/** Inline Markdown of `source` appended to `parent` as text nodes and safe elements. */
export function renderInline(source, parent) {
  let last = 0;
  INLINE.lastIndex = 0;
  for (const m of source.matchAll(INLINE)) {
    text(source.slice(last, m.index), parent);
    last = m.index + m[0].length;
    const wrap = (tag, inner) => {
      const node = el(tag);
      renderInline(inner, node);
      parent.append(node);
    };
    if (m[1] !== undefined) parent.append(document.createTextNode(m[1]));
    else if (m[2] !== undefined) parent.append(el("code", "", m[3].replace(/^ (.+) $/, "$1")));
    else if (m[4] !== undefined || m[5] !== undefined) wrap("strong", m[4] ?? m[5]);
    else if (m[6] !== undefined) wrap("del", m[6]);
    else if (m[7] !== undefined || m[8] !== undefined) wrap("em", m[7] ?? m[8]);
    else if (m[9] !== undefined) link(m[9], m[10], parent);
    else link(m[11] ?? m[12], m[11] ?? m[12], parent, true);
  }
  text(source.slice(last), parent);
}
