//! The README documents every metric the indexer exports (drift guard).

#[test]
fn every_metric_is_in_the_readme_table() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    for name in kvmesh_indexer::metrics::ALL {
        assert!(readme.contains(&format!("| `{name}`")), "README.md metrics table lacks `{name}`");
    }
}
