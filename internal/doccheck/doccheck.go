// Package doccheck holds no code: its tests hold the pages under docs/ to
// the module's source, for what no other package's tests can see whole
// (the metric families every collector registers, the import rules of
// docs/architecture.md).
package doccheck
