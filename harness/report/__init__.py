"""Reports of results: results.json, Markdown, JUnit and the console table (results), HTML (html), the throughput benchmark's table and plot (bench).
Imports only harness.core."""
