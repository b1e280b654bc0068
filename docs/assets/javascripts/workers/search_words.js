/* The sites' search worker: Material's own, with Chinese queries cut into whole words first.

   tools/mkdocs_hooks.py points the pages at this script, with the name of Material's worker after the "?"
   of its address, and this script loads that worker. Two things change, both for Chinese only:

   1. A query is cut into the words of the index. jieba cut the book's Chinese into words when the site
      was built (引用计数 into 引用 and 计数); Material cuts a query again in the browser, but never tries
      a word that ends the query, so 引用计数 became 引用** and 计*, which matched 计时器 and 计算 in
      headings and missed the chapters about reference counts. Here each run of Chinese characters is cut
      from the left, the longest word of the index first, and Material's own cutting is turned off.
   2. The words of one run are all required: 引用计数 is one term, not "引用 or 计数". Words typed apart,
      and English, keep Material's "any of the words, the more the better". */

const HAN = /\p{sc=Han}/u
let words = new Set()  // the index's Chinese words, known once Material has built the index
let longest = 1        // the longest of them, in characters

// 引用计数 -> "+引用* +计数*": required, and each may still be being typed (Material adds no "*" after a "+").
function cut(query) {
  return query.replace(/\p{sc=Han}+/gu, run => {
    const pieces = []
    for (let i = 0; i < run.length;) {
      let n = Math.min(longest, run.length - i)
      while (n > 1 && !words.has(run.slice(i, i + n)))
        n--
      pieces.push(run.slice(i, i + n))
      i += n
    }
    return pieces.length > 1 ? pieces.map(piece => `+${piece}*`).join(" ") : run
  })
}

// Listening before Material's worker is loaded, this sees each query (message type 2) before Material does.
addEventListener("message", event => {
  if (event.data.type === 2)
    event.data.data = cut(event.data.data)
})

// Only Material's own worker, named as the site's pages name it (search.<hash>.min.js, beside this file)
var worker = decodeURIComponent(location.search.slice(1))
if (!/^search\.[0-9a-f]+\.min\.js$/.test(worker)) throw new Error("search_words.js: not a search worker: " + worker)
importScripts(worker)

// When Material builds its index (lunr's Builder.build), note the index's Chinese words, and hide them from
// Material's own cutting, which asks `word in index.invertedIndex` (lunr itself never asks `in`).
const build = lunr.Builder.prototype.build
lunr.Builder.prototype.build = function () {
  const index = build.call(this)
  words = new Set(Object.keys(index.invertedIndex).filter(term => HAN.test(term)))
  for (const word of words)
    longest = Math.max(longest, word.length)
  index.invertedIndex = new Proxy(index.invertedIndex, {
    has: (terms, term) => !HAN.test(term) && term in terms,
  })
  return index
}
