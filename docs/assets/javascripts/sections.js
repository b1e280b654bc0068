/* The language menu keeps the reader's section.

   tools/mkdocs_hooks.py gives each prose heading of a chapter the id of the same heading in the other
   language, URL-encoded: data-twin-zh on the English site, data-twin-en on the Chinese one. When a link
   of the language menu is about to be followed (pressed, focused or clicked), it gets the id of the
   section being read: the last heading above the top third of the window. Where no heading is above
   it (the top of a chapter, or a page without such headings), the link leads to the other page's top. */

function keepSection(event) {
  const link = event.target.closest?.(".md-select__link[hreflang]")
  if (!link)
    return
  const lang = link.getAttribute("hreflang")
  let id = ""
  for (const heading of document.querySelectorAll(`[data-twin-${lang}]`)) {
    if (heading.getBoundingClientRect().top > window.innerHeight / 3)
      break
    id = heading.getAttribute(`data-twin-${lang}`)
  }
  link.hash = id  // "" drops the "#"
}

for (const type of ["pointerdown", "focusin", "click"])
  document.addEventListener(type, keepSection, true)
