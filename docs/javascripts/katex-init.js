// Eq. 1-4 typeset in the browser by KaTeX 0.16.47, shipped with the site (javascripts/katex/, MIT licence, from the
// npm registry): the math renders with no network. pymdownx.arithmatex leaves \( \) and \[ \] in span.arithmatex.
document$.subscribe(({ body }) => {
  renderMathInElement(body, {
    delimiters: [{left: "\\(", right: "\\)", display: false}, {left: "\\[", right: "\\]", display: true}],
    throwOnError: false,
  })
})
