"""Reports of results: results.json, Markdown, JUnit and the console table (results), HTML (html).
Imports only harness.core."""
