//! The resource set: one rule per mirrored kind, as data (docs/architecture.md).
//!
//! A [`Rule`] says which objects of a kind are sources (a label selector), which labels and
//! annotations cross to the copy (allow-lists), which labels are added from fields, which fields
//! are dropped, which status paths are carried, and when to hold (publish nothing, withdraw
//! nothing). The five defaults ([`default_rules`]) are built in; a YAML file given with
//! `--rules` adds rules or overrides defaults by name ([`load`]), so a new kind needs no code. A
//! default is turned off by its name alone: `{name: networks, enabled: false}`.

use std::{collections::BTreeSet, path::Path};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::{
    core::{Expression, Selector},
    discovery::ApiResource,
};
use serde::{Deserialize, Serialize};

/// Label on every copy naming the location that published it (docs/architecture.md). The sweep selects on
/// it; an object without it is never modified or deleted; an object with it is never a source.
pub const LOCATION_LABEL: &str = "replicator.datumapis.com/location";
/// Label Karmada puts on objects it delivers to members; such objects are never sources.
pub const KARMADA_MANAGED_LABEL: &str = "karmada.io/managed";

/// Errors found while loading or validating rules. Each names the rule and the field.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The rules file could not be read.
    #[error("failed to read rules file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The rules file is not valid YAML for the rule schema.
    #[error("failed to parse rules file {path}: {message}")]
    Parse {
        /// The file.
        path: String,
        /// The parser's message (line and column included).
        message: String,
    },
    /// A rule has an invalid field.
    #[error("rule {rule:?}: field {field}: {message}")]
    Invalid {
        /// The rule's name.
        rule: String,
        /// The offending field, as written in YAML.
        field: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// Result of rule loading.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The group, version, kind and plural of a mirrored resource.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceKind {
    /// API group; empty for the core group.
    #[serde(default)]
    pub group: String,
    /// API version, for example `v1alpha`.
    pub version: String,
    /// Kind, for example `NetworkInterface`.
    pub kind: String,
    /// Plural resource name, for example `networkinterfaces`.
    pub plural: String,
}

impl ResourceKind {
    fn new(group: &str, version: &str, kind: &str, plural: &str) -> Self {
        Self {
            group: group.into(),
            version: version.into(),
            kind: kind.into(),
            plural: plural.into(),
        }
    }

    /// `group/version`, or `version` for the core group: the `apiVersion` of objects of this kind.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// The dynamic API resource for `Api<DynamicObject>`.
    pub fn api_resource(&self) -> ApiResource {
        ApiResource {
            group: self.group.clone(),
            version: self.version.clone(),
            api_version: self.api_version(),
            kind: self.kind.clone(),
            plural: self.plural.clone(),
        }
    }
}

/// Which keys of a string map (labels or annotations) cross from source to copy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KeyAllowList {
    /// Every key crosses when true; `keys` and `prefixes` are then ignored.
    #[serde(default)]
    pub all: bool,
    /// Exact keys that cross.
    #[serde(default)]
    pub keys: BTreeSet<String>,
    /// Key prefixes (e.g. `compute.datumapis.com/`) whose keys cross.
    #[serde(default)]
    pub prefixes: Vec<String>,
}

impl KeyAllowList {
    /// The list that lets nothing cross.
    pub fn none() -> Self {
        Self::default()
    }

    /// The list that lets everything cross.
    pub fn all() -> Self {
        Self {
            all: true,
            ..Self::default()
        }
    }

    /// Whether `key` crosses.
    pub fn allows(&self, key: &str) -> bool {
        self.all || self.keys.contains(key) || self.prefixes.iter().any(|p| key.starts_with(p.as_str()))
    }
}

/// A dotted path into an object, e.g. `spec.claimRef.name`. Segments are JSON object keys.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(try_from = "String", into = "String")]
pub struct FieldPath(Vec<String>);

impl FieldPath {
    /// The path's segments.
    pub fn segments(&self) -> &[String] {
        &self.0
    }
}

impl TryFrom<String> for FieldPath {
    type Error = String;

    fn try_from(s: String) -> Result<Self, String> {
        let segments: Vec<String> = s.split('.').map(str::to_owned).collect();
        if s.is_empty() || segments.iter().any(String::is_empty) {
            return Err(format!("{s:?} is not a dotted field path (e.g. spec.claimRef)"));
        }
        Ok(Self(segments))
    }
}

impl From<FieldPath> for String {
    fn from(p: FieldPath) -> String {
        p.0.join(".")
    }
}

impl std::fmt::Display for FieldPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.join("."))
    }
}

/// Where an added label's value comes from.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum LabelValueSource {
    /// The source object's namespace name.
    SourceNamespace,
    /// A string field of the source object; the label is absent when the field is.
    Field(FieldPath),
}

/// A label the copy carries that the source does not (e.g. `held-by` from `spec.claimRef.name`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AddedLabel {
    /// Label key on the copy.
    pub key: String,
    /// Where its value comes from.
    pub from: LabelValueSource,
}

/// When a source is held: nothing is published and nothing already published is withdrawn.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum Hold {
    /// Held while the list at this path is absent or empty (galactic slices with zero endpoints,
    /// a partial write: seed 003, "Publish on observation only").
    EmptyList(FieldPath),
}

/// One mirrored kind and how its copies are made (docs/architecture.md).
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Rule {
    /// Unique rule name; a file rule with a default's name overrides it.
    pub name: String,
    /// The kind mirrored (same group/version/kind on cell and hub).
    pub resource: ResourceKind,
    /// Only objects matching this selector are sources; absent means all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_selector: Option<LabelSelector>,
    /// Labels carried from source to copy. The set on the copy is replaced, never merged.
    #[serde(default)]
    pub labels: KeyAllowList,
    /// Labels added from the source's fields.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub labels_added: Vec<AddedLabel>,
    /// Annotations carried from source to copy.
    #[serde(default)]
    pub annotations: KeyAllowList,
    /// Paths removed from the copy (top level or nested, e.g. `spec.claimRef`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fields_dropped: Vec<FieldPath>,
    /// Status paths (relative to `status`) carried through the status subresource; empty means
    /// the copy's status is never written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub status: Vec<FieldPath>,
    /// When to publish nothing and withdraw nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold: Option<Hold>,
    /// A file rule with `enabled: false` removes the default of the same name.
    #[serde(default = "enabled_default")]
    pub enabled: bool,
}

fn enabled_default() -> bool {
    true
}

/// The galactic tenant label: an EndpointSlice carrying it is a source (seed 003).
pub const GALACTIC_TENANT_LABEL: &str = "galactic.datum.net/tenant-id";
/// Location label carried on NetworkContext, Subnet and NetworkInterface copies.
pub const NETWORK_LOCATION_LABEL: &str = "networking.datumapis.com/location";
/// Network label carried on NetworkContext and Subnet copies.
pub const NETWORK_LABEL: &str = "networking.datumapis.com/network";
/// Label added to NetworkInterface copies: the claim holding the interface.
pub const HELD_BY_LABEL: &str = "networking.datumapis.com/held-by";
/// Label added to NetworkInterface copies: the source namespace.
pub const SOURCE_NAMESPACE_LABEL: &str = "networking.datumapis.com/source-namespace";

/// The built-in resource set of docs/architecture.md: Network, NetworkContext, Subnet, NetworkInterface
/// (projection) and galactic EndpointSlices.
pub fn default_rules() -> Vec<Rule> {
    let networking = |kind: &str, plural: &str| ResourceKind::new(crate::api::GROUP, crate::api::VERSION, kind, plural);
    let path = |p: &str| FieldPath(p.split('.').map(str::to_owned).collect());
    let context_labels = KeyAllowList {
        keys: [NETWORK_LOCATION_LABEL, NETWORK_LABEL]
            .into_iter()
            .map(String::from)
            .collect(),
        ..KeyAllowList::default()
    };
    let base = |name: &str, resource: ResourceKind| Rule {
        name: name.into(),
        resource,
        source_selector: None,
        labels: KeyAllowList::none(),
        labels_added: vec![],
        annotations: KeyAllowList::none(),
        fields_dropped: vec![],
        status: vec![],
        hold: None,
        enabled: true,
    };
    vec![
        base("networks", networking("Network", "networks")),
        Rule {
            labels: context_labels.clone(),
            ..base("networkcontexts", networking("NetworkContext", "networkcontexts"))
        },
        Rule {
            labels: context_labels,
            ..base("subnets", networking("Subnet", "subnets"))
        },
        Rule {
            labels: KeyAllowList {
                keys: [NETWORK_LOCATION_LABEL.to_owned()].into(),
                prefixes: vec!["compute.datumapis.com/".into()],
                all: false,
            },
            labels_added: vec![
                AddedLabel {
                    key: HELD_BY_LABEL.into(),
                    from: LabelValueSource::Field(path("spec.claimRef.name")),
                },
                AddedLabel {
                    key: SOURCE_NAMESPACE_LABEL.into(),
                    from: LabelValueSource::SourceNamespace,
                },
            ],
            fields_dropped: vec![path("spec.claimRef"), path("spec.attachmentMode")],
            status: vec![path("phase"), path("conditions")],
            ..base("networkinterfaces", networking("NetworkInterface", "networkinterfaces"))
        },
        Rule {
            source_selector: Some(LabelSelector {
                match_expressions: Some(vec![
                    k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                        key: GALACTIC_TENANT_LABEL.into(),
                        operator: "Exists".into(),
                        values: None,
                    },
                ]),
                match_labels: None,
            }),
            labels: KeyAllowList::all(),
            annotations: KeyAllowList::all(),
            hold: Some(Hold::EmptyList(path("endpoints"))),
            ..base(
                "endpointslices",
                ResourceKind::new("discovery.k8s.io", "v1", "EndpointSlice", "endpointslices"),
            )
        },
    ]
}

/// The rules file: `rules:` followed by a list of [`Rule`]s in camelCase YAML.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RulesFile {
    rules: Vec<FileRule>,
}

/// A [`Rule`] as the file writes it: `resource` may be left out by an entry that only disables a
/// default (`{name: networks, enabled: false}`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct FileRule {
    name: String,
    #[serde(default)]
    resource: Option<ResourceKind>,
    #[serde(default)]
    source_selector: Option<LabelSelector>,
    #[serde(default)]
    labels: KeyAllowList,
    #[serde(default)]
    labels_added: Vec<AddedLabel>,
    #[serde(default)]
    annotations: KeyAllowList,
    #[serde(default)]
    fields_dropped: Vec<FieldPath>,
    #[serde(default)]
    status: Vec<FieldPath>,
    #[serde(default)]
    hold: Option<Hold>,
    #[serde(default = "enabled_default")]
    enabled: bool,
}

/// What one file entry does to the rule set.
enum Entry {
    /// Add this rule, or replace the default of its name.
    Rule(Box<Rule>),
    /// Remove the default of this name.
    Disable(String),
}

impl FileRule {
    /// The entry's effect. An entry without `resource` may only disable a default.
    fn entry(self, defaults: &[String]) -> Result<Entry> {
        let Some(resource) = self.resource else {
            let missing = |message: String| Error::Invalid {
                rule: self.name.clone(),
                field: "resource",
                message,
            };
            if !defaults.contains(&self.name) {
                return Err(missing(format!(
                    "required: {:?} is not a default rule ({}), so the entry must name its resource",
                    self.name,
                    defaults.join(", ")
                )));
            }
            if self.enabled {
                return Err(missing(
                    "required unless the entry disables the default (`enabled: false`); an override \
                     repeats the whole rule"
                        .to_owned(),
                ));
            }
            return Ok(Entry::Disable(self.name));
        };
        Ok(Entry::Rule(Box::new(Rule {
            name: self.name,
            resource,
            source_selector: self.source_selector,
            labels: self.labels,
            labels_added: self.labels_added,
            annotations: self.annotations,
            fields_dropped: self.fields_dropped,
            status: self.status,
            hold: self.hold,
            enabled: self.enabled,
        })))
    }
}

/// The default rules, overridden and extended by the rules file at `path` when given, validated.
/// A file entry with a default's name replaces that default (the whole rule); one with
/// `enabled: false` removes it, and needs no `resource` then.
///
/// # Errors
/// [`Error::Read`] / [`Error::Parse`] for an unreadable or malformed file, [`Error::Invalid`]
/// naming the rule and field for a rule that fails [`validate`] or an entry without `resource`
/// that does not disable a default.
pub fn load(path: Option<&Path>) -> Result<Vec<Rule>> {
    let mut rules = default_rules();
    if let Some(path) = path {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
            path: path.display().to_string(),
            source,
        })?;
        let file: RulesFile = serde_saphyr::from_str(&text).map_err(|e| Error::Parse {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let defaults: Vec<String> = rules.iter().map(|r| r.name.clone()).collect();
        let entries = file
            .rules
            .into_iter()
            .map(|r| r.entry(&defaults))
            .collect::<Result<Vec<_>>>()?;
        rules = merge(rules, entries);
    }
    rules.retain(|r| r.enabled);
    for rule in &rules {
        validate(rule)?;
    }
    // Two rules for one kind would write the same copies under one field manager and undo each
    // other's writes forever: one rule per kind.
    for (i, rule) in rules.iter().enumerate() {
        if let Some(first) = rules[..i]
            .iter()
            .find(|r| r.resource.group == rule.resource.group && r.resource.kind == rule.resource.kind)
        {
            return Err(invalid(
                rule,
                "resource",
                format!(
                    "kind {} is already mirrored by rule {:?}; override that rule by name instead",
                    rule.resource.kind, first.name
                ),
            ));
        }
    }
    Ok(rules)
}

/// Overrides `defaults` by name with the file's rules and appends the new ones, keeping order; a
/// disabling entry marks the default of its name disabled.
fn merge(mut defaults: Vec<Rule>, entries: Vec<Entry>) -> Vec<Rule> {
    for entry in entries {
        match entry {
            Entry::Rule(rule) => match defaults.iter_mut().find(|d| d.name == rule.name) {
                Some(existing) => *existing = *rule,
                None => defaults.push(*rule),
            },
            Entry::Disable(name) => {
                for rule in defaults.iter_mut().filter(|d| d.name == name) {
                    rule.enabled = false;
                }
            }
        }
    }
    defaults
}

fn invalid(rule: &Rule, field: &'static str, message: impl Into<String>) -> Error {
    Error::Invalid {
        rule: rule.name.clone(),
        field,
        message: message.into(),
    }
}

/// Checks one rule: names are DNS labels, the selector parses, label keys are valid, dropped
/// paths never touch `metadata`, `apiVersion` or `kind`.
///
/// # Errors
/// [`Error::Invalid`] naming the rule and the field.
pub fn validate(rule: &Rule) -> Result<()> {
    if !is_dns_label(&rule.name) {
        return Err(invalid(rule, "name", "must be a lowercase DNS label"));
    }
    if rule.resource.kind.is_empty() || rule.resource.version.is_empty() {
        return Err(invalid(rule, "kind", "kind and version are required"));
    }
    if !is_dns_label(&rule.resource.plural) {
        return Err(invalid(rule, "plural", "must be a lowercase DNS label"));
    }
    source_selector(rule)?;
    for added in &rule.labels_added {
        if !is_label_key(&added.key) {
            return Err(invalid(
                rule,
                "labelsAdded",
                format!("{:?} is not a valid label key", added.key),
            ));
        }
    }
    for key in rule.labels.keys.iter().chain(&rule.annotations.keys) {
        if !is_label_key(key) {
            return Err(invalid(rule, "labels", format!("{key:?} is not a valid key")));
        }
    }
    for path in &rule.fields_dropped {
        if matches!(
            path.segments().first().map(String::as_str),
            Some("metadata" | "apiVersion" | "kind")
        ) {
            return Err(invalid(rule, "fieldsDropped", format!("{path} cannot be dropped")));
        }
    }
    Ok(())
}

/// The server-side selector for a rule's source watch: the rule's selector plus the loop guard
/// (`!replicator.datumapis.com/location,!karmada.io/managed`, docs/architecture.md), so copies delivered
/// back into a cell are never sources.
///
/// # Errors
/// [`Error::Invalid`] when the rule's selector has an unknown operator or missing values.
pub fn source_selector(rule: &Rule) -> Result<Selector> {
    let mut selector = match &rule.source_selector {
        Some(ls) => Selector::try_from(ls.clone()).map_err(|e| invalid(rule, "sourceSelector", e.to_string()))?,
        None => Selector::default(),
    };
    selector.extend([
        Expression::DoesNotExist(LOCATION_LABEL.into()),
        Expression::DoesNotExist(KARMADA_MANAGED_LABEL.into()),
    ]);
    Ok(selector)
}

/// Whether `s` is an RFC 1123 DNS label (lowercase alphanumerics and `-`, at most 63 characters).
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Whether `s` is a valid label value (at most 63 characters of `[A-Za-z0-9._-]`, alphanumeric
/// at both ends, or empty).
pub fn is_label_value(s: &str) -> bool {
    s.is_empty()
        || (s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && s.as_bytes().first().is_some_and(u8::is_ascii_alphanumeric)
            && s.as_bytes().last().is_some_and(u8::is_ascii_alphanumeric))
}

/// Whether `s` is a valid label or annotation key: `[prefix/]name` with a DNS subdomain prefix.
pub fn is_label_key(s: &str) -> bool {
    let (prefix, name) = match s.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    let prefix_ok = prefix.is_none_or(|p| p.len() <= 253 && p.split('.').all(is_dns_label));
    prefix_ok && !name.is_empty() && is_label_value(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(name: &str) -> Rule {
        default_rules().into_iter().find(|r| r.name == name).unwrap()
    }

    #[test]
    fn the_defaults_are_the_five_kinds_of_design_section_3_and_valid() {
        let names: Vec<_> = default_rules().iter().map(|r| r.name.clone()).collect();
        assert_eq!(
            names,
            [
                "networks",
                "networkcontexts",
                "subnets",
                "networkinterfaces",
                "endpointslices"
            ]
        );
        for r in default_rules() {
            validate(&r).unwrap();
        }
    }

    #[test]
    fn interface_labels_allow_compute_prefix_and_location_only() {
        let r = rule("networkinterfaces");
        assert!(r.labels.allows("compute.datumapis.com/workload"));
        assert!(r.labels.allows("networking.datumapis.com/location"));
        assert!(!r.labels.allows("networking.datumapis.com/network"));
        assert!(!r.labels.allows("app"));
    }

    #[test]
    fn source_selector_adds_the_loop_guard() {
        let s = source_selector(&rule("endpointslices")).unwrap().to_string();
        assert_eq!(
            s,
            "galactic.datum.net/tenant-id,!replicator.datumapis.com/location,!karmada.io/managed"
        );
        let s = source_selector(&rule("networks")).unwrap().to_string();
        assert_eq!(s, "!replicator.datumapis.com/location,!karmada.io/managed");
    }

    #[test]
    fn a_rules_file_overrides_by_name_adds_and_disables() {
        let dir = std::env::temp_dir().join(format!("replicator-rules-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("rules.yaml");
        std::fs::write(
            &file,
            r#"
rules:
  - name: networks
    resource: {version: v1alpha, kind: Network, plural: networks}
    enabled: false
  - name: vpcattachments
    resource:
      group: cloud.datumapis.com
      version: v1alpha1
      kind: VPCAttachment
      plural: vpcattachments
    labels:
      prefixes: ["cloud.datumapis.com/"]
    fieldsDropped: [spec.nodeName]
    status: [conditions]
"#,
        )
        .unwrap();
        let rules = load(Some(&file)).unwrap();
        let names: Vec<_> = rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "networkcontexts",
                "subnets",
                "networkinterfaces",
                "endpointslices",
                "vpcattachments"
            ]
        );
        let vpc = rules.last().unwrap();
        assert_eq!(vpc.resource.api_version(), "cloud.datumapis.com/v1alpha1");
        assert_eq!(vpc.fields_dropped[0].to_string(), "spec.nodeName");
        assert!(vpc.labels.allows("cloud.datumapis.com/vpc"));
    }

    fn load_text(tag: &str, text: &str) -> Result<Vec<Rule>> {
        let dir = std::env::temp_dir().join(format!("replicator-rules-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("rules.yaml");
        std::fs::write(&file, text).unwrap();
        load(Some(&file))
    }

    #[test]
    fn a_default_is_disabled_by_its_name_alone() {
        let rules = load_text(
            "disable",
            "rules:\n  - {name: networks, enabled: false}\n  - name: endpointslices\n    enabled: false\n",
        )
        .unwrap();
        let names: Vec<_> = rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["networkcontexts", "subnets", "networkinterfaces"]);
        // The others are the defaults, untouched.
        assert_eq!(rules[2], rule("networkinterfaces"));

        // Disabled, then given again in full further down: the later entry wins, as for overrides.
        let rules = load_text(
            "disable-then-override",
            "rules:\n  - {name: networks, enabled: false}\n  - name: networks\n    resource: {group: networking.datumapis.com, version: v1alpha, kind: Network, plural: networks}\n    labels: {all: true}\n",
        )
        .unwrap();
        let networks = rules.iter().find(|r| r.name == "networks").unwrap();
        assert!(networks.labels.all);
    }

    #[test]
    fn an_entry_without_resource_must_disable_a_default() {
        let err = load_text("unknown", "rules:\n  - {name: vpcattachments, enabled: false}\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "rule \"vpcattachments\": field resource: required: \"vpcattachments\" is not a default rule \
             (networks, networkcontexts, subnets, networkinterfaces, endpointslices), so the entry must name its resource"
        );
        let err = load_text(
            "unknown-enabled",
            "rules:\n  - name: vpcattachments\n    labels: {all: true}\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with(
                "rule \"vpcattachments\": field resource: required: \"vpcattachments\" is not a default rule"
            ),
            "{err}"
        );
        let err = load_text("partial", "rules:\n  - name: networks\n    labels: {all: true}\n")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "rule \"networks\": field resource: required unless the entry disables the default (`enabled: false`); \
             an override repeats the whole rule"
        );
    }

    #[test]
    fn invalid_rules_name_the_rule_and_field() {
        let mut r = rule("subnets");
        r.fields_dropped = vec![FieldPath::try_from("metadata.labels".to_owned()).unwrap()];
        let err = validate(&r).unwrap_err().to_string();
        assert_eq!(
            err,
            "rule \"subnets\": field fieldsDropped: metadata.labels cannot be dropped"
        );

        let mut r = rule("subnets");
        r.source_selector = Some(LabelSelector {
            match_expressions: Some(vec![
                k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement {
                    key: "a".into(),
                    operator: "Sometimes".into(),
                    values: None,
                },
            ]),
            match_labels: None,
        });
        assert!(
            validate(&r)
                .unwrap_err()
                .to_string()
                .starts_with("rule \"subnets\": field sourceSelector:")
        );

        let mut r = rule("subnets");
        r.resource.plural = "Subnets".into();
        assert_eq!(
            validate(&r).unwrap_err().to_string(),
            "rule \"subnets\": field plural: must be a lowercase DNS label"
        );
    }

    #[test]
    fn two_rules_for_one_kind_are_refused() {
        let dir = std::env::temp_dir().join(format!("replicator-rules-dup-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("rules.yaml");
        std::fs::write(
            &file,
            "rules:\n  - name: nif-extra\n    resource: {group: networking.datumapis.com, version: v1alpha, kind: NetworkInterface, plural: networkinterfaces}\n    labels: {all: true}\n",
        )
        .unwrap();
        let err = load(Some(&file)).unwrap_err().to_string();
        assert_eq!(
            err,
            "rule \"nif-extra\": field resource: kind NetworkInterface is already mirrored by rule \"networkinterfaces\"; override that rule by name instead"
        );
    }

    #[test]
    fn a_malformed_rules_file_is_a_parse_error_naming_the_file() {
        let dir = std::env::temp_dir().join(format!("replicator-rules-bad-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("rules.yaml");
        std::fs::write(&file, "rules:\n  - name: x\n    colour: blue\n").unwrap();
        let err = load(Some(&file)).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("failed to parse rules file {}", file.display())),
            "{err}"
        );
    }

    #[test]
    fn label_key_and_value_checks() {
        assert!(is_label_key("networking.datumapis.com/location"));
        assert!(is_label_key("app"));
        assert!(!is_label_key("Bad_Prefix/x"));
        assert!(!is_label_key("a/"));
        assert!(is_label_value(""));
        assert!(is_label_value("claim-1"));
        assert!(!is_label_value("-x"));
        assert!(!is_label_value(&"a".repeat(64)));
    }
}
